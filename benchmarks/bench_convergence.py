"""Convergence of every scheme side by side: accuracy and perplexity, several seeds, time to quality.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bench_convergence.py \\
        [--models digits lstm] [--seeds 0 1 2] [--schemes ...] [--out out/bench_convergence]
    make bench-convergence            (the same, 2 workers)

SAFusion's argument is accuracy at speed (SAFusion §2.4, §5 Experiment 1, Figure 13): sparsifying
each tensor ahead of fusion keeps every tensor, where selecting over a fused buffer drops some.
DGC (Lin et al., ICLR'18) reaches dense accuracy at density 0.001 only with momentum correction,
factor masking, local clipping and a warm-up (§3.2–3.3). This benchmark trains the same model
from the same initialisation on the same data order for every scheme and seed:

* ``digits`` — the digits CNN (``examples/digits.py``, width 32: 14 tensors, 61 k weights) on
  scikit-learn's digits (1,437 training / 360 test images), batch 32 per worker, SGD lr 0.05
  momentum 0.9, ``--digits-epochs`` epochs; metric: test accuracy (higher is better).
* ``lstm`` — an LSTM language model (``examples/models.py``: embedding 128, one layer of 128
  units, vocabulary 4,000, dropout 0.2: 1.16 M weights, 89 % in the embedding and the decoder) on
  the Python standard library's source tokenised with :mod:`tokenize` (``examples/corpus.py``;
  the first 1.5 M characters, every 10th file held out: about 180 k training tokens, the first
  20 k held-out tokens evaluated), 16 sequences × 35 tokens per worker, SGD lr 0.5 momentum 0.9,
  gradients clipped to norm 0.25
  as a Horovod user does (``synchronize()``, ``clip_grad_norm_``, ``step()`` under
  ``skip_synchronize()``), ``--lstm-epochs`` epochs; metric: validation perplexity (lower is better).

Schemes (keys): ``horovod`` (``hvd.DistributedOptimizer``, dense); ``ddp-powersgd`` (PyTorch DDP
with PowerSGD's hook, rank 4, dense for the warm-up's steps, one bucket; a ``torch.distributed``
gloo group in the same processes); ``FUSION@DENSITY`` for each fusion planner in ``--fusions``
and density in ``--densities`` with DGC's compressor (the default), and the same with ``+dgc``:
``momentum_correction=True`` (with DGC's momentum factor masking), ``warmup_steps`` =
``--warmup-fraction`` of the run (exponential schedule) and, where the task clips,
``local_clipping`` at the same norm instead of the global clip; ``safusion@D+dgc+nomask`` the
same without masking; ``safusion@0.01/COMPRESSOR`` for every other registered compressor.
``--schemes`` also takes single techniques: ``+mc``, ``+nomask``, ``+clip``, ``+warmup``. Ours
always sparsify (``dense=False``), so the comparison is of the sparse algorithms.

Per model, scheme and seed the metric is evaluated ``--evals`` times per epoch; training time
(excluding evaluation) is kept with each point. The report gives per scheme the median final
metric over seeds with its min–max, its difference to dense Horovod's median, the mean density
actually sent, and the time to quality: median seconds (and steps) until the metric first reaches
dense Horovod's median final metric within 1 accuracy point / 3 % perplexity (``—`` if some seed
never does). Everything runs on one machine, so seconds compare schemes' overheads, not a
network. Curves go to ``--out``/convergence_{model}.png, the table and every curve to
``--out``/results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import horovod.torch as hvd
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import horovod_safusion as saf  # noqa: E402
from corpus import stdlib_split  # noqa: E402
from digits import DigitsCNN, accuracy, load_digits_split  # noqa: E402
from models import LSTMLanguageModel  # noqa: E402

sys.path.insert(0, HERE)
from links import free_port  # noqa: E402

FUSIONS = ("safusion", "wfbp", "oktopk", "omgs", "cupcake")
DENSITIES = (0.01, 0.001)
POWERSGD_RANK = 4
QUALITY = {"digits": 0.01, "lstm": 0.03}  # within 1 accuracy point / 3 % perplexity of dense


# ---- tasks --------------------------------------------------------------------------------------
class Task:
    """A model, its data (this rank's batches in a seed-dependent order) and its metric."""

    higher_is_better = True
    clip: float | None = None

    def __init__(self, args, rank: int, size: int) -> None:
        self.args, self.rank, self.size = args, rank, size

    def steps_per_epoch(self) -> int:
        return self.n_train // (self.batch * self.size)

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        """The same permutation on every rank and for every scheme of a seed."""
        return torch.randperm(self.n_train, generator=torch.Generator().manual_seed(seed * 1000 + epoch))


class Digits(Task):
    name, metric = "digits", "test accuracy"

    def __init__(self, args, rank, size):
        super().__init__(args, rank, size)
        self.x, self.y, self.x_te, self.y_te = load_digits_split()
        self.n_train, self.batch, self.lr, self.epochs = len(self.x), 32, 0.05, args.digits_epochs

    def model(self):
        return DigitsCNN(width=32)

    def loss(self, model, perm, i):
        first = (i * self.size + self.rank) * self.batch
        idx = perm[first:first + self.batch]
        return F.cross_entropy(model(self.x[idx]), self.y[idx])

    def evaluate(self, model) -> float:
        return accuracy(model, self.x_te, self.y_te)


class LSTM(Task):
    name, metric, higher_is_better, clip = "lstm", "validation perplexity", False, 0.25
    bptt = 35

    def __init__(self, args, rank, size):
        super().__init__(args, rank, size)
        self.train_ids, valid, self.itos = stdlib_split(vocab=4000, max_chars=1_500_000)
        self.valid = valid[:args.valid_tokens]
        self.n_train = (len(self.train_ids) - 1) // self.bptt  # windows
        self.batch, self.lr, self.epochs = 16, 0.5, args.lstm_epochs

    def model(self):
        return LSTMLanguageModel(len(self.itos), embed=128, hidden=128, layers=1, dropout=0.2)

    def loss(self, model, perm, i):
        first = (i * self.size + self.rank) * self.batch
        starts = perm[first:first + self.batch] * self.bptt
        idx = starts[:, None] + torch.arange(self.bptt)
        logits = model(self.train_ids[idx])
        return F.cross_entropy(logits.flatten(0, 1), self.train_ids[idx + 1].flatten())

    def evaluate(self, model) -> float:
        model.eval()
        n = (len(self.valid) - 1) // self.bptt
        with torch.no_grad():
            idx = torch.arange(n)[:, None] * self.bptt + torch.arange(self.bptt)
            total = 0.0
            for chunk in idx.split(64):
                logits = model(self.valid[chunk])
                total += F.cross_entropy(logits.flatten(0, 1), self.valid[chunk + 1].flatten(),
                                         reduction="sum").item()
        model.train()
        return float(np.exp(total / (n * self.bptt)))


TASKS = {"digits": Digits, "lstm": LSTM}


# ---- schemes ------------------------------------------------------------------------------------
def scheme_keys(args) -> list[str]:
    keys = ["horovod", "ddp-powersgd"]
    for fusion in args.fusions:
        for d in args.densities:
            keys += [f"{fusion}@{d:g}", f"{fusion}@{d:g}+dgc"]
    keys += [f"safusion@{d:g}+dgc+nomask" for d in args.densities if "safusion" in args.fusions]
    others = [c for c in saf.available_compressors() if c not in ("none", "dgc")]
    keys += [f"safusion@0.01/{c}" for c in others]
    return keys


TECHNIQUES = {"mc": "momentum correction", "nomask": "without momentum factor masking", "clip": "local clipping", "warmup": "density warm-up"}
DGC = {"mc", "clip", "warmup"}


def parse_key(key: str) -> dict:
    """``fusion@density[/compressor][+technique...]`` → optimizer keyword arguments and the set of
    DGC techniques (``+dgc`` is ``+mc+clip+warmup``, masking on)."""
    body, *flags = key.split("+")
    techniques = set()
    for f in flags:
        if f != "dgc" and f not in TECHNIQUES:
            raise SystemExit(f"--schemes {key}: unknown technique +{f}; known: +dgc, "
                             + ", ".join(f"+{t} ({d})" for t, d in TECHNIQUES.items()))
        techniques |= DGC if f == "dgc" else {f}
    fusion, _, rest = body.partition("@")
    density, _, compressor = rest.partition("/")
    if fusion not in saf.available_planners():
        raise SystemExit(f"--schemes {key}: {fusion!r} is not a fusion planner; known: "
                         f"{', '.join(saf.available_planners())}")
    out = {"fusion": fusion, "density": float(density), "techniques": techniques}
    if compressor:
        out["compressor"] = compressor
    return out


def build(key: str, task: Task, seed: int, total_steps: int, args):
    """(model, optimizer, clip after synchronize?) of one scheme, from the seed's initialisation."""
    torch.manual_seed(seed)
    model = task.model()
    sgd = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.9)
    warmup = max(1, int(args.warmup_fraction * total_steps))
    if key == "horovod":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model, hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters()), task.clip
    if key == "ddp-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
        # One bucket: the hook starts its 2nd and 3rd allreduce from completion callbacks, and with
        # several buckets Gloo ranks can start them in different orders (seen as an abort,
        # "op.preamble.length <= op.nbytes", in a job that also ran Horovod).
        mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=int(mb) + 1)
        ddp.register_comm_hook(P.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                               start_powerSGD_iter=max(2, warmup)), P.powerSGD_hook)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=task.lr, momentum=0.9), task.clip
    kw = parse_key(key)
    techniques = kw.pop("techniques")
    extra = {"momentum_correction": "mc" in techniques, "momentum_masking": "nomask" not in techniques,
             "warmup_steps": warmup if "warmup" in techniques else 0}
    local = "clip" in techniques and task.clip is not None
    if local:
        extra["local_clipping"] = task.clip
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = saf.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), dense=False, **kw, **extra)
    return model, opt, None if local else task.clip


def train(key: str, task: Task, seed: int, args) -> dict:
    model, opt, clip = build(key, task, seed, task.steps_per_epoch() * task.epochs, args)
    return fit(model, opt, clip, task, seed, args)


def fit(model, opt, clip: float | None, task: Task, seed: int, args) -> dict:
    """Train ``model`` with ``opt`` (clipping the aggregate gradient to ``clip``) for the task's
    epochs in the seed's data order, evaluating ``args.evals`` times per epoch. Seconds are
    training time only (``cpu_seconds``: this process's CPU time over the same steps, all its
    threads); the evaluations' time is kept apart (``eval_seconds``)."""
    per_epoch = task.steps_per_epoch()
    torch.manual_seed(seed * 7919 + task.rank)  # dropout: the same stream for every scheme
    evals = sorted({max(1, round(per_epoch * (j + 1) / args.evals)) for j in range(args.evals)})
    curve, densities, elapsed, cpu, evaluating, step = [], [], 0.0, 0.0, 0.0, 0
    for epoch in range(task.epochs):
        perm = task.order(seed, epoch)
        for i in range(per_epoch):
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            task.loss(model, perm, i).backward()
            if clip is not None and hasattr(opt, "synchronize"):  # Horovod's recipe: clip the aggregate
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                with opt.skip_synchronize():
                    opt.step()
            else:  # DDP's gradients are averaged by backward() already
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
            elapsed += time.perf_counter() - t0
            cpu += time.process_time() - c0
            step += 1
            stats = getattr(opt, "last_stats", None)
            if stats is not None:
                densities.append(stats.density)
            if i + 1 in evals:
                t0 = time.perf_counter()
                curve.append({"step": step, "seconds": elapsed, "metric": task.evaluate(model)})
                evaluating += time.perf_counter() - t0
    return {"curve": curve, "final": curve[-1]["metric"], "seconds": elapsed, "steps": step,
            "cpu_seconds": cpu, "eval_seconds": evaluating, "density": float(np.mean(densities)) if densities else 1.0}


# ---- report -------------------------------------------------------------------------------------
def summarise(model: str, runs: dict, higher: bool) -> dict:
    """Per scheme: median and min–max of the final metric over seeds, and time to quality."""
    dense = float(np.median([r["final"] for r in runs["horovod"].values()])) if "horovod" in runs else None
    tol = QUALITY[model]
    target = None if dense is None else (dense - tol if higher else dense * (1 + tol))
    rows = {}
    for key, by_seed in runs.items():
        finals = np.array([r["final"] for r in by_seed.values()])
        reach = []
        for r in by_seed.values():
            hit = next((p for p in r["curve"] if (p["metric"] >= target if higher else p["metric"] <= target)), None) \
                if target is not None else None
            reach.append(hit)
        rows[key] = {"median": float(np.median(finals)), "min": float(finals.min()), "max": float(finals.max()),
                     "seeds": len(finals), "density": float(np.mean([r["density"] for r in by_seed.values()])),
                     "seconds": float(np.median([r["seconds"] for r in by_seed.values()])),
                     "vs_dense": None if dense is None else (float(np.median(finals)) - dense if higher
                                                             else float(np.median(finals)) / dense - 1),
                     "to_quality_s": None if any(h is None for h in reach) else float(np.median([h["seconds"] for h in reach])),
                     "to_quality_steps": None if any(h is None for h in reach) else int(np.median([h["step"] for h in reach]))}
    return {"dense": dense, "target": target, "rows": rows}


def print_table(model: str, task_cls, s: dict, args, workers: int) -> None:
    higher = task_cls.higher_is_better
    unit = "points" if higher else "%"
    print(f"\n{model}: {task_cls.metric}, {workers} workers, seeds {args.seeds}; quality target "
          f"{s['target']:.4g} (dense median {s['dense']:.4g} {'−' if higher else '+'} "
          f"{QUALITY[model] * 100:g}{' points' if higher else ' %'})")
    print(f"{'scheme':<26} {'final median [min–max]':>28} {'vs dense':>10} {'density':>8} "
          f"{'train s':>8} {'to quality s (steps)':>21}")
    for key, r in s["rows"].items():
        vs = "" if r["vs_dense"] is None else (f"{100 * r['vs_dense']:+.2f} {unit}" if higher
                                               else f"{100 * r['vs_dense']:+.1f} {unit}")
        tq = "—" if r["to_quality_s"] is None else f"{r['to_quality_s']:.1f} ({r['to_quality_steps']})"
        print(f"{key:<26} {r['median']:>10.4f} [{r['min']:.4f}–{r['max']:.4f}] {vs:>10} "
              f"{r['density']:>8.4f} {r['seconds']:>8.1f} {tq:>21}")


def plot(model: str, task_cls, runs: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {"dense and PowerSGD": lambda k: "@" not in k,
              "density 0.01": lambda k: "@0.01" in k and "/" not in k,
              "density 0.001": lambda k: "@0.001" in k,
              "compressors (safusion, 0.01)": lambda k: "/" in k}
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), sharey=True)
    for ax, (title, pick) in zip(axes, groups.items()):
        for key in runs:
            if not (pick(key) or key == "horovod"):
                continue
            curves = [r["curve"] for r in runs[key].values()]
            steps = [p["step"] for p in curves[0]]
            med = np.median([[p["metric"] for p in c] for c in curves], axis=0)
            ax.plot(steps, med, label=key, lw=2 if key == "horovod" else 1,
                    ls="--" if "+" in key else "-")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
    axes[0].set_ylabel(f"{task_cls.metric} (median of seeds)")
    if not task_cls.higher_is_better:
        axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main ---------------------------------------------------------------------------------------
#: The options of the training itself (the tasks' length, evaluation and warm-up), which
#: ``bench_time_to_accuracy`` passes on to its workers.
TRAINING_ARGS = ("digits_epochs", "lstm_epochs", "evals", "valid_tokens", "warmup_fraction")


def add_training_args(ap: argparse.ArgumentParser) -> None:
    """The options of :data:`TRAINING_ARGS`."""
    ap.add_argument("--digits-epochs", type=int, default=8)
    ap.add_argument("--lstm-epochs", type=int, default=2)
    ap.add_argument("--evals", type=int, default=4, help="evaluations per epoch")
    ap.add_argument("--valid-tokens", type=int, default=20000, help="lstm: held-out tokens evaluated")
    ap.add_argument("--warmup-fraction", type=float, default=0.1,
                    help="DGC's warm-up (+dgc schemes) and PowerSGD's dense start, as a fraction of the run's steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--fusions", nargs="+", default=list(FUSIONS))
    ap.add_argument("--densities", nargs="+", type=float, default=list(DENSITIES))
    ap.add_argument("--schemes", nargs="+", help="only these keys (default: every scheme; see the docstring)")
    add_training_args(ap)
    ap.add_argument("--out", default="out/bench_convergence")
    args = ap.parse_args()
    keys = args.schemes or scheme_keys(args)
    for k in keys:
        if k not in ("horovod", "ddp-powersgd"):
            parse_key(k)

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    import torch.distributed as dist
    port = hvd.broadcast_object(free_port() if rank == 0 else None, root_rank=0, name="bench.port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    results = {}
    t_start = time.time()
    for model in args.models:
        task = TASKS[model](args, rank, size)
        runs: dict = {k: {} for k in keys}
        with tqdm(total=len(keys) * len(args.seeds), desc=f"{model}", disable=rank != 0, file=sys.stdout,
                  dynamic_ncols=True) as bar:
            for seed in args.seeds:
                for key in keys:
                    bar.set_postfix_str(f"seed {seed} {key}")
                    runs[key][seed] = train(key, task, seed, args)
                    bar.update()
        results[model] = {"runs": runs, "summary": summarise(model, runs, task.higher_is_better),
                          "steps_per_epoch": task.steps_per_epoch(), "epochs": task.epochs,
                          "params": sum(p.numel() for p in task.model().parameters())}
        if rank == 0:  # each model's table and files as soon as it is done
            print_table(model, TASKS[model], results[model]["summary"], args, size)
            os.makedirs(args.out, exist_ok=True)
            plot(model, TASKS[model], runs, os.path.join(args.out, f"convergence_{model}.png"))
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump({"args": vars(args), "workers": size, "torch": torch.__version__,
                           "minutes": (time.time() - t_start) / 60, "results": results}, f, indent=1)
    if rank == 0:
        print(f"\n{(time.time() - t_start) / 60:.1f} minutes; wrote {args.out}/results.json and "
              f"convergence_*.png")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
