"""Memory per worker: the plugin against Horovod on a model that is mostly one large tensor.

    python benchmarks/bench_memory.py [--np 2] [--steps 40] [--schemes horovod safusion ...]
                                      [--out out/bench_memory]

The probe of the memory issue: an ``EmbeddingBag(50000, 400)`` and a ``Linear(400, 2000)``
(20.8 M weights, 83 MB in float32), SGD with momentum 0.9, batch 64 per worker of bags of 32
consecutive tokens of the Python standard library's source (``examples/corpus.py``), the
target the token after the bag (the 1999 most frequent tokens, the rest one class).

Every scheme runs in its own ``horovodrun -np N --gloo`` job (resident memory is per process),
which first trains a small model a few steps with both optimizers, so that what a process
allocates once is in every scheme's figures alike.
Per worker and step: ``VmRSS`` after ``step()``, the step's own peak over the resident set before
it (``VmHWM`` restarted per step, :func:`horovod_safusion.memory.reset_peak`: where a peak comes
from), and the run's peak. After the last step, :func:`horovod_safusion.memory.held` sums what the plugin holds in its own tensors,
and rank 0 lists every tensor storage alive in the process (``gc``), the parameters, gradients
and momentum buffers marked as the user's. The report gives, per scheme, the steady resident
memory (median over the second half of the steps) and the peak, both as the difference to
Horovod's in multiples of the model, and the plugin's own tensors; a PNG shows RSS per step.

Schemes: ``horovod`` (``hvd.DistributedOptimizer``), ``safusion`` (the default), and variants
``safusion:key=value:...`` with ``horovod_safusion.DistributedOptimizer`` keyword arguments
(``dense=false``, ``communicator=spardl``, ``momentum_correction=true``, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, HERE)
from links import job_environ  # noqa: E402
from schemes import Scheme, describe, parse, print_resolved  # noqa: E402

#: glibc serves allocations from this size on as mappings of their own (fixed: by default it raises
#: the threshold as large blocks are freed and serves them from the heap, whose pages stay resident
#: after a free, so the resident set would depend on the order of past allocations, by up to the
#: model's size between two runs of the same job), so the resident set follows tensors as they come and go.
MMAP_THRESHOLD = 1 << 16
DEFAULT_SCHEMES = ("horovod", "safusion", "safusion:dense=false", "safusion:dense=false:momentum_correction=true",
                   "safusion:dense=false:communicator=spardl", "safusion:dense=false:communicator=zen")


def resolve(label: str) -> Scheme:
    """``label`` in :mod:`schemes`' grammar; this benchmark measures Horovod's optimizer and ours."""
    scheme = parse(label)
    if scheme.peer not in (None, "horovod"):
        raise SystemExit(f"--schemes {label}: bench_memory measures horovod and our optimizer, not {scheme.peer}")
    return scheme


def probe_model():
    import torch.nn as nn

    class BagClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(50000, 400, mode="mean")
            self.out = nn.Linear(400, 2000)

        def forward(self, x):
            return self.out(self.bag(x))

    return BagClassifier()


def probe_data(rank: int, size: int, batch: int, bag: int = 32):
    import torch
    from corpus import stdlib_corpus

    ids, _ = stdlib_corpus(vocab=50000)
    n = len(ids)
    span = torch.arange(bag)

    def data(step: int):
        first = (step * size + rank) * batch
        starts = ((first + torch.arange(batch)) * (bag + 1)) % (n - bag - 1)
        x = ids[starts[:, None] + span]
        y = ids[starts + bag].clamp(max=1999)
        return x, y
    return data


def all_storages() -> list[dict]:
    """Every strided tensor storage reachable by ``gc`` (distinct), with a tensor's shape and dtype."""
    import gc
    import torch
    seen, out = set(), []
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.layout != torch.strided:
                continue
            s = obj.untyped_storage()
        except Exception:
            continue
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        out.append({"ptr": s.data_ptr(), "bytes": s.nbytes(), "shape": list(obj.shape), "dtype": str(obj.dtype)})
    return sorted(out, key=lambda d: -d["bytes"])


def warm_up_process(saf) -> None:
    """Train a small model a few steps with Horovod's optimizer and with the plugin, so that what a
    process allocates once (Horovod's and Gloo's buffers, the compiled kernels, thread pools) is
    in every scheme's resident set alike, and the differences between schemes are what each holds
    for the model."""
    import torch
    import torch.nn.functional as F
    import horovod.torch as hvd

    for make in (lambda m, o: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters()),
                 lambda m, o: saf.DistributedOptimizer(o, named_parameters=m.named_parameters(), dense=False,
                                                       profile_steps=2)):
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = make(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        for step in range(8):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 10, (8,))).backward()
            opt.step()


def worker(args) -> None:
    import torch
    import torch.nn.functional as F
    import horovod.torch as hvd
    import horovod_safusion as saf
    from horovod_safusion import memory
    from tqdm import tqdm

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    warm_up_process(saf)
    torch.manual_seed(0)
    model = probe_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheme = resolve(args.scheme)
    if scheme.peer == "horovod":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    else:
        opt = saf.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), **scheme.kwargs())
    data = probe_data(rank, size, args.batch_size)
    rss, hwm, rise, losses = [], [], [], []
    peak = memory.rss()["hwm"]
    for step in tqdm(range(args.steps), desc=args.scheme, disable=rank != 0, file=sys.stdout, dynamic_ncols=True):
        x, y = data(step)
        before = memory.rss()["rss"]
        memory.reset_peak()  # this step's own peak; the run's is kept in `peak`
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        now = memory.rss()
        peak = max(peak, now["hwm"])
        rss.append(now["rss"])
        hwm.append(peak)
        rise.append(now["hwm"] - before)
        losses.append(float(loss.detach()))
    out = {"scheme": args.scheme, "rank": rank, "size": size, "rss": rss, "hwm": peak, "hwm_steps": hwm,
           "rise": rise, "model_bytes": memory.model_bytes(opt), "losses": losses}
    if args.scheme != "horovod":
        h = memory.held(opt)
        out["held"] = {"bytes": h.bytes, "by_path": h.by_path}
        out["plan"] = {"buffers": len(opt.plan.buffers), "planner": opt.plan.planner, "dense": opt.plan.dense}
    if rank == 0:
        user = memory.user_storages(opt)
        out["storages"] = [dict(d, user=("cpu", d["ptr"]) in user) for d in all_storages()]
    with open(f"{args.out}/raw.{args.tag}.rank{rank}.json", "w") as f:
        json.dump(out, f)


def median_mb(values) -> float:
    return float(np.median(values)) / 1e6


def report(args, results: dict[str, list[dict]]) -> dict:
    base = results.get("horovod")
    model = results[next(iter(results))][0]["model_bytes"]
    summary = {}
    for scheme, ranks in results.items():
        half = args.steps // 2
        steady = [float(np.median(r["rss"][half:])) for r in ranks]
        peak = [float(r["hwm"]) for r in ranks]
        row = {"steady_rss": steady, "peak_rss": peak,
               "held": [r.get("held", {}).get("bytes", 0) for r in ranks],
               "plan": ranks[0].get("plan")}
        if base is not None:
            b_steady = [float(np.median(r["rss"][half:])) for r in base]
            b_peak = [float(r["hwm"]) for r in base]
            row["steady_over_horovod"] = [(s - b) / model for s, b in zip(steady, b_steady)]
            row["peak_over_horovod"] = [(p - b) / model for p, b in zip(peak, b_peak)]
        summary[scheme] = row
    print(f"\nmodel: {model / 1e6:.1f} MB of trainable float32; {args.np} workers, {args.steps} steps; "
          "RSS per worker (MB), worst rank; 'x model' = (scheme - horovod) / model")
    head = f"{'scheme':<52} {'steady':>8} {'peak':>8} {'steady x':>9} {'peak x':>8} {'held x':>7}  plan"
    print(head)
    print("-" * len(head))
    for scheme, row in summary.items():
        so = max(row.get("steady_over_horovod", [float("nan")]))
        po = max(row.get("peak_over_horovod", [float("nan")]))
        plan = row["plan"] or {}
        plan_s = f"{plan.get('planner')}, {plan.get('buffers')} buffers{', dense' if plan.get('dense') else ''}" if plan else ""
        print(f"{scheme:<52} {max(row['steady_rss']) / 1e6:8.0f} {max(row['peak_rss']) / 1e6:8.0f} "
              f"{so:9.2f} {po:8.2f} {max(row['held']) / model:7.2f}  {plan_s}")
    print("\nthe largest rise within one step over the resident set before it (x model), worst rank:")
    for scheme, ranks in results.items():
        step, rise = max(((i, v) for r in ranks for i, v in enumerate(r["rise"])), key=lambda iv: iv[1])
        print(f"  {scheme:<52} step {step:>3}: {rise / model:5.2f}")
    for scheme, ranks in results.items():
        r0 = next(r for r in ranks if r["rank"] == 0)
        if "held" in r0:
            print(f"\n{scheme}: the plugin's own tensors on rank 0 (storage, first path that reaches it)")
            for path, n in list(r0["held"]["by_path"].items())[:10]:
                print(f"  {n / 1e6:9.2f} MB  {path}")
        big = [s for s in r0["storages"] if s["bytes"] >= model // 20]
        print(f"{scheme}: storages of at least 5 % of the model alive on rank 0 after the run:")
        for s in big:
            print(f"  {s['bytes'] / 1e6:9.2f} MB  {s['dtype']:<14} {str(s['shape']):<16} {'user' if s['user'] else 'other'}")
    return summary


def plot(args, results: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for scheme, ranks in results.items():
        r0 = next(r for r in ranks if r["rank"] == 0)
        ax.plot(np.arange(len(r0["rss"])), np.array(r0["rss"]) / 1e6, label=scheme)
    ax.set_xlabel("step")
    ax.set_ylabel("VmRSS of rank 0 after step() (MB)")
    ax.set_title("Resident memory per worker, EmbeddingBag(50000, 400) + Linear(400, 2000)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{args.out}/bench_memory.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES))
    ap.add_argument("--out", default="out/bench_memory")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    print_resolved([describe(resolve(label)) for label in args.schemes])  # a malformed label stops here
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for i, scheme in enumerate(args.schemes):
        tag = f"s{i}"
        cmd = ["horovodrun", "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo", sys.executable,
               os.path.abspath(__file__), "--worker", "--scheme", scheme, "--tag", tag, "--out", args.out,
               "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
        given = resolve(scheme).env  # the label's variables; its PYTHONPATH (another tree) comes first
        env = job_environ(**given, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
        tree = [given["PYTHONPATH"]] if "PYTHONPATH" in given else []
        env["PYTHONPATH"] = os.pathsep.join([*tree, os.path.join(ROOT, "examples"), ROOT])
        proc = subprocess.run(cmd, env=env)
        if proc.returncode:
            print(f"{scheme}: the job failed (exit {proc.returncode})", file=sys.stderr)
            continue
        results[scheme] = [json.load(open(f"{args.out}/raw.{tag}.rank{r}.json")) for r in range(args.np)]
    summary = report(args, results)
    with open(f"{args.out}/results.json", "w") as f:
        json.dump({"summary": summary, "steps": args.steps, "np": args.np}, f, indent=1)
    plot(args, results)


if __name__ == "__main__":
    main()
