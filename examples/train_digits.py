"""Main job: train a CNN on scikit-learn's digits with Horovod's dense optimizer and with
horovod-safusion, side by side, and print time to accuracy, accuracy, throughput and traffic.

    horovodrun -np 2 -H localhost:2 --gloo python examples/train_digits.py [--link NAME]
    make demo     (as root: on an emulated 100 Mbit/s link; see examples/demo.py)

Every rank trains on its own shard of the training set; both runs start from the same weights,
see the same batches and use the same optimizer settings, so only gradient synchronisation differs.
The plugin runs as a user runs it after the one-line change: its defaults, with
``density="auto"`` (the density the link hides) and ``dense="auto"`` (on a link fast enough for
a model this size, a dense allreduce; rank 0 says what it chose). The target accuracy is Horovod's
final test accuracy less 1 point; time is training time, evaluations excluded.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
import horovod.torch as hvd
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import DigitsCNN, accuracy, load_digits_split  # noqa: E402

import horovod_safusion as saf  # noqa: E402


def train(scheme: str, args, data) -> dict:
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(args.seed)
    model = DigitsCNN(width=args.width)
    base = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    if scheme == "horovod":
        optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    else:
        optimizer = saf.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                             compressor=args.compressor, density=args.density,
                                             fusion=args.fusion, dense=args.dense)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    shard = torch.arange(hvd.rank(), len(x_tr), hvd.size())
    steps_per_epoch = len(shard) // args.batch_size
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    sent, steps, train_time, curve = 0, 0, 0.0, []
    bar = tqdm(range(args.epochs), desc=f"{scheme:>16}", disable=hvd.rank() != 0, leave=True)
    for _ in bar:
        order = shard[torch.randperm(len(shard), generator=gen)]
        t0 = time.perf_counter()
        for s in range(steps_per_epoch):
            idx = order[s * args.batch_size:(s + 1) * args.batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
            optimizer.step()
            sent += dense_bytes if scheme == "horovod" else optimizer.last_stats.bytes_sent
            steps += 1
        train_time += time.perf_counter() - t0
        curve.append((train_time, accuracy(model, x_te, y_te)))
        bar.set_postfix(test_acc=f"{curve[-1][1]:.3f}", refresh=False)
    # Every rank measured its own time; the job is as fast as its slowest rank.
    seconds = hvd.allreduce(torch.tensor([t for t, _ in curve], dtype=torch.float64), op=hvd.Max,
                            name=f"time.{scheme}").tolist()
    if scheme != "horovod":
        plan = optimizer.plan
        scheme += " (sent dense)" if plan.dense else f" ({args.compressor}@{optimizer.target_density:g})"
    return {"scheme": scheme, "acc": curve[-1][1], "curve": list(zip(seconds, [a for _, a in curve])),
            "samples_per_s": steps * args.batch_size * hvd.size() / seconds[-1],
            "bytes_per_step": sent / steps}


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """Training seconds until the test accuracy first reached ``target`` (checked every epoch)."""
    return next((t for t, acc in curve if acc >= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by the worker count")
    ap.add_argument("--compressor", default="dgc")
    ap.add_argument("--density", default="auto", help="a number in (0, 1], or auto (the default)")
    ap.add_argument("--fusion", default="safusion")
    ap.add_argument("--dense", default="auto", choices=("auto", "true", "false"), help="the optimizer's dense=")
    ap.add_argument("--width", type=int, default=64, help="the CNN's width (64: 145 k weights, 0.58 MB per step)")
    ap.add_argument("--link", default="loopback", help="the link's name, for the table (examples/demo.py sets it)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.dense = {"auto": "auto", "true": True, "false": False}[args.dense]
    args.density = args.density if args.density == "auto" else float(args.density)

    hvd.init()
    torch.set_num_threads(1)
    data = load_digits_split()
    results = [train("horovod", args, data), train(f"safusion/density={args.density}", args, data)]
    if hvd.rank() == 0:
        target = results[0]["acc"] - 0.01
        print(f"\ndigits CNN (width {args.width}), {hvd.size()} workers, {args.epochs} epochs, batch "
              f"{args.batch_size}/worker, link: {args.link}")
        print(f"target: test accuracy {target:.4f} (Horovod's final less 1 point); seconds of training, "
              "evaluations excluded")
        print(f"{'scheme':<36} {'s to target':>11} {'test acc':>8} {'samples/s':>10} {'bytes sent/step':>16}")
        for r in results:
            reached = time_to(r["curve"], target)
            print(f"{r['scheme']:<36} {'never' if reached is None else f'{reached:.1f}':>11} {r['acc']:>8.4f} "
                  f"{r['samples_per_s']:>10.0f} {r['bytes_per_step']:>16,.0f}")
        ratio = results[0]["bytes_per_step"] / results[1]["bytes_per_step"]
        reached = [time_to(r["curve"], target) for r in results]
        sooner = (f"target reached {reached[0] / reached[1]:.2f}x as fast as Horovod" if None not in reached
                  else "target not reached by both")
        print(f"traffic reduction: {ratio:.1f}x; {sooner}")


if __name__ == "__main__":
    main()
