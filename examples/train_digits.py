"""Main job: train a CNN on scikit-learn's digits with Horovod's dense optimizer and with
horovod-safusion, side by side, and print accuracy, throughput and traffic.

    horovodrun -np 2 -H localhost:2 --gloo python examples/train_digits.py

Every rank trains on its own shard of the training set; both runs start from the same weights,
see the same batches and use the same optimizer settings, so only gradient synchronisation differs.

The demo shows the sparse path, so it passes ``dense=False`` (``--dense false``): on loopback a
model this small is faster with a dense allreduce, and the optimizer's default ``dense="auto"``
would find that out and send dense (``--dense auto`` shows it; rank 0 says so).
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
    model = DigitsCNN()
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
    sent, steps, train_time = 0, 0, 0.0
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
        bar.set_postfix(test_acc=f"{accuracy(model, x_te, y_te):.3f}", refresh=False)
    # Every rank measured its own time; the job is as fast as its slowest rank.
    train_time = hvd.allreduce(torch.tensor(train_time), op=hvd.Max, name=f"time.{scheme}").item()
    if scheme != "horovod" and getattr(optimizer.plan, "dense", False):
        scheme += " (sent dense)"
    return {"scheme": scheme, "acc": accuracy(model, x_te, y_te),
            "samples_per_s": steps * args.batch_size * hvd.size() / train_time,
            "bytes_per_step": sent / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by the worker count")
    ap.add_argument("--compressor", default="dgc")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--fusion", default="safusion")
    ap.add_argument("--dense", default="false", choices=("auto", "true", "false"),
                    help="the optimizer's dense= (the demo shows the sparse path: false)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.dense = {"auto": "auto", "true": True, "false": False}[args.dense]

    hvd.init()
    torch.set_num_threads(1)
    data = load_digits_split()
    results = [train("horovod", args, data), train(f"safusion/{args.compressor}@{args.density:g}", args, data)]
    if hvd.rank() == 0:
        print(f"\ndigits CNN, {hvd.size()} workers, {args.epochs} epochs, batch {args.batch_size}/worker")
        print(f"{'scheme':<32} {'test acc':>8} {'samples/s':>10} {'bytes sent/step':>16}")
        for r in results:
            print(f"{r['scheme']:<32} {r['acc']:>8.4f} {r['samples_per_s']:>10.0f} {r['bytes_per_step']:>16,.0f}")
        ratio = results[0]["bytes_per_step"] / results[1]["bytes_per_step"]
        print(f"traffic reduction: {ratio:.1f}x")


if __name__ == "__main__":
    main()
