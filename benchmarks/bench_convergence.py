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
  20 k held-out tokens evaluated), 16 sequences × 35 tokens per worker, SGD lr 3.2 (near dense's
  best at this budget; docs/benchmarks.md has the sweep) momentum 0.9, gradients clipped to norm
  0.25 (``--lstm-clip``; 0: no clip) as a Horovod user does (``synchronize()``,
  ``clip_grad_norm_``, ``step()`` under ``skip_synchronize()``), ``--lstm-epochs`` epochs; metric:
  validation perplexity (lower is better).

Schemes (labels of :mod:`schemes`' grammar, the same everywhere): ``horovod``
(``hvd.DistributedOptimizer``, dense); ``ddp-powersgd-1bucket`` (PyTorch DDP with PowerSGD's
hook, rank 4, dense for the warm-up's steps, one bucket — a ``torch.distributed`` gloo group in
the same processes as Horovod, where DDP's default buckets abort); ``FUSION@DENSITY`` for each
fusion planner in ``--fusions`` and density in ``--densities`` with DGC's compressor (the
default), and the same with ``+dgc``: ``momentum_correction=True`` (with DGC's momentum factor
masking), ``warmup_steps`` = ``--warmup-fraction`` of the run (exponential schedule) and, where the
task clips, ``local_clipping`` at the same norm instead of the global clip;
``safusion@D+dgc+nomask`` the same without masking; ``safusion@0.01/COMPRESSOR`` for every other
registered compressor. ``--schemes`` also takes single techniques: ``+mc``, ``+nomask``,
``+clip``, ``+warmup``, ``+densestart`` (the warm-up's steps sent dense,
``warmup_schedule="dense"``, as PowerSGD's ``start_powerSGD_iter``), ``+ef21``
(``error_feedback="ef21-sgdm"``) and ``+classic`` (``momentum_correction=False``: classic error
feedback under the SGD's momentum). A key without ``+mc``, ``+ef21`` or ``+classic`` keeps the
plugin's default (``momentum_correction="auto"``: DGC's correction for this SGD, with masking by
tensor, ``momentum_masking="auto"``; ``+nomask`` alone: the correction without masking,
``momentum_masking=False``). This benchmark runs ours with ``dense=False`` and critical
regimes at the default's interval (``critical_regimes=10``: what the default does where it sends
sparse, since ``dense=False`` alone turns them off; a label's ``:dense=...`` or
``:critical_regimes=none`` overrides either), so the comparison is of the sparse algorithms; rank 0
prints what each label resolved to.

Per model, scheme and seed the metric is evaluated ``--evals`` times per epoch, each worker on its
own shard of the held-out set (the ranks' sums added); training time (excluding evaluation) is
kept with each point. The report gives per scheme the median final
metric over seeds with its min–max, its difference to dense Horovod's median, the mean density
actually sent, and the time to quality: median seconds (and steps) until the metric first reaches
dense Horovod's median final metric within 1 accuracy point / 3 % perplexity (``—`` if some seed
never does). Everything runs on one machine, so seconds compare schemes' overheads, not a
network. Curves go to ``--out``/convergence_{model}.png, the table and every curve to
``--out``/results.json.

``--steps N`` trains the first N steps only (instead of the epochs; the warm-ups' fractions are
of N), ``--eval-every K`` evaluates every K steps instead of ``--evals`` per epoch, and
``--digits-width`` / ``--digits-lr`` set the digits CNN's width and learning rate and ``--lstm-lr``
the LSTM's (defaults as above), ``--min-selected`` our schemes' ``min_selected`` (default: the optimizer's).
``--diagnostics`` records at every step, for every scheme, the loss, the local gradient's norm, the update's and the momentum's norms, the update's cosine with the workers' mean gradient and, for ours, the error-feedback residual's norm and
age and the age of what was sent (:class:`Diagnostics`), all global over the ranks; it prints one
more table per model (medians over seeds at steps 11, 22, 44 and the last) and draws
``--out``/lag_{model}.png; the records go to results.json under each run's ``diagnostics``. A lag
study::

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bench_convergence.py --models digits \\
        --digits-width 64 --digits-lr 0.04 --schemes horovod safusion@0.01 safusion@0.1 safusion@0.1+mc \\
        --diagnostics --steps 66 --eval-every 2 --out out/lag_digits
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
import horovod.torch as hvd
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from corpus import stdlib_split  # noqa: E402
from digits import DigitsCNN, load_digits_split  # noqa: E402
from models import LSTMLanguageModel  # noqa: E402

sys.path.insert(0, HERE)
from links import free_port  # noqa: E402
from schemes import Scheme, ddp_powersgd, describe, horovod_optimizer, our_optimizer, parse, print_resolved  # noqa: E402

FUSIONS = ("safusion", "wfbp", "oktopk", "omgs", "cupcake")
DENSITIES = (0.01, 0.001)
QUALITY = {"digits": 0.01, "lstm": 0.03}  # within 1 accuracy point / 3 % perplexity of dense


# ---- tasks --------------------------------------------------------------------------------------
class Task:
    """A model, its data (this rank's batches in a seed-dependent order) and its metric.

    The metric is evaluated in shards: each rank evaluates its own slice of the held-out set and
    ``allsum`` (a collective every rank calls at the same step: Horovod's allreduce, or
    ``torch.distributed``'s in a DDP job) adds the ranks' sums, so that P workers on one machine
    share one evaluation's work instead of each doing all of it. The replicas are the same model
    at every step, so the metric is the whole set's (up to the order of the sum)."""

    higher_is_better = True
    clip: float | None = None

    def __init__(self, args, rank: int, size: int, allsum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.args, self.rank, self.size, self.allsum = args, rank, size, allsum

    def shard(self, n: int) -> torch.Tensor:
        """This rank's indices of ``n`` held-out items (contiguous, the sizes differing by at most one)."""
        return torch.tensor_split(torch.arange(n), self.size)[self.rank]

    def evaluate(self, model) -> float:
        """The metric of ``model`` (a DDP model's own module: its forward is no collective) on the
        whole held-out set: this rank's shard's (sum, count), summed over the ranks."""
        model = getattr(model, "module", model)
        model.eval()
        with torch.no_grad():
            total, count = self.allsum(torch.tensor(self.shard_sums(model), dtype=torch.float64)).tolist()
        model.train()
        return self.metric_of(total, count)

    def shard_sums(self, model) -> tuple[float, float]:
        """(sum, count) of the metric's terms over this rank's shard."""
        raise NotImplementedError

    def metric_of(self, total: float, count: float) -> float:
        return total / count

    def steps_per_epoch(self) -> int:
        return self.n_train // (self.batch * self.size)

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        """The same permutation on every rank and for every scheme of a seed."""
        return torch.randperm(self.n_train, generator=torch.Generator().manual_seed(seed * 1000 + epoch))


class Digits(Task):
    name, metric = "digits", "test accuracy"

    def __init__(self, args, rank, size, allsum):
        super().__init__(args, rank, size, allsum)
        self.x, self.y, self.x_te, self.y_te = load_digits_split()
        self.n_train, self.batch, self.epochs = len(self.x), 32, args.digits_epochs
        self.lr, self.width = args.digits_lr, args.digits_width

    def model(self):
        return DigitsCNN(width=self.width)

    def loss(self, model, perm, i):
        first = (i * self.size + self.rank) * self.batch
        idx = perm[first:first + self.batch]
        return F.cross_entropy(model(self.x[idx]), self.y[idx])

    def shard_sums(self, model) -> tuple[float, float]:
        idx = self.shard(len(self.y_te))
        return float((model(self.x_te[idx]).argmax(1) == self.y_te[idx]).sum()), float(len(idx))


class LSTM(Task):
    name, metric, higher_is_better, clip = "lstm", "validation perplexity", False, 0.25
    bptt = 35

    def __init__(self, args, rank, size, allsum):
        super().__init__(args, rank, size, allsum)
        self.train_ids, valid, self.itos = stdlib_split(vocab=4000, max_chars=1_500_000)
        self.valid = valid[:args.valid_tokens]
        self.n_train = (len(self.train_ids) - 1) // self.bptt  # windows
        self.batch, self.lr, self.epochs = 16, args.lstm_lr, args.lstm_epochs
        self.clip = args.lstm_clip or None

    def model(self):
        return LSTMLanguageModel(len(self.itos), embed=128, hidden=128, layers=1, dropout=0.2)

    def loss(self, model, perm, i):
        first = (i * self.size + self.rank) * self.batch
        starts = perm[first:first + self.batch] * self.bptt
        idx = starts[:, None] + torch.arange(self.bptt)
        logits = model(self.train_ids[idx])
        return F.cross_entropy(logits.flatten(0, 1), self.train_ids[idx + 1].flatten())

    def shard_sums(self, model) -> tuple[float, float]:
        windows = self.shard((len(self.valid) - 1) // self.bptt)
        idx = windows[:, None] * self.bptt + torch.arange(self.bptt)
        total = 0.0
        for chunk in idx.split(64):
            logits = model(self.valid[chunk])
            total += F.cross_entropy(logits.flatten(0, 1), self.valid[chunk + 1].flatten(), reduction="sum").item()
        return total, float(idx.numel())

    def metric_of(self, total: float, count: float) -> float:
        return float(np.exp(total / count))


TASKS = {"digits": Digits, "lstm": LSTM}


def horovod_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over the job's ranks, through Horovod (a job that runs Horovod)."""
    return hvd.allreduce(t, op=hvd.Sum, name="bench.evaluate")


# ---- schemes ------------------------------------------------------------------------------------
def scheme_keys(args) -> list[str]:
    keys = ["horovod", "ddp-powersgd-1bucket"]
    for fusion in args.fusions:
        for d in args.densities:
            keys += [f"{fusion}@{d:g}", f"{fusion}@{d:g}+dgc"]
    keys += [f"safusion@{d:g}+dgc+nomask" for d in args.densities if "safusion" in args.fusions]
    import horovod_safusion as saf

    others = [c for c in saf.available_compressors() if c not in ("none", "dgc")]
    keys += [f"safusion@0.01/{c}" for c in others]
    return keys


def resolve(key: str) -> Scheme:
    """``key`` in :mod:`schemes`' grammar: ``horovod``, ``ddp-powersgd-1bucket`` or ours. DDP's
    default buckets cannot run here: the job also runs Horovod, and with several buckets Gloo
    ranks can start PowerSGD's allreduces in different orders (:func:`~schemes.ddp_powersgd`)."""
    scheme = parse(key)
    if scheme.peer not in (None, "horovod", "ddp-powersgd-1bucket"):
        raise SystemExit(f"--schemes {key}: bench_convergence runs horovod, ddp-powersgd-1bucket and our schemes "
                         "(DDP's default buckets cannot share a job with Horovod under Gloo; see bench_time_to_accuracy)")
    return scheme


def warmup_steps(total_steps: int, args) -> int:
    """DGC's warm-up, a dense start and PowerSGD's dense start: ``--warmup-fraction`` of the run."""
    return max(1, int(args.warmup_fraction * total_steps))


def our_kwargs(scheme: Scheme, task: Task, total_steps: int, args) -> dict:
    """Our optimizer's arguments: the label's, on this benchmark's defaults — ``dense=False`` (it
    compares the sparse algorithms' learning) with the default's critical regimes, and
    ``--min-selected`` where given."""
    from horovod_safusion.regime import DEFAULT_INTERVAL  # here: a peer's job must not import the plugin

    defaults = {"dense": False, "critical_regimes": DEFAULT_INTERVAL}
    if getattr(args, "min_selected", None) is not None:
        defaults["min_selected"] = args.min_selected
    return scheme.kwargs(warmup_steps=warmup_steps(total_steps, args), clip=task.clip, defaults=defaults)


def build(key: str, task: Task, seed: int, total_steps: int, args):
    """(model, optimizer, clip after synchronize?) of one scheme, from the seed's initialisation."""
    scheme = resolve(key)
    torch.manual_seed(seed)
    model = task.model()
    sgd = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.9)
    if scheme.peer == "horovod":
        return model, horovod_optimizer(scheme, sgd, model), task.clip
    if scheme.peer is not None:  # one bucket: this job also runs Horovod
        ddp = ddp_powersgd(model, start_iter=max(2, warmup_steps(total_steps, args)), one_bucket=True)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=task.lr, momentum=0.9), task.clip
    kw = our_kwargs(scheme, task, total_steps, args)
    return model, our_optimizer(sgd, model, kw), None if scheme.clips_locally(kw) else task.clip


def total_steps(task: Task, args) -> int:
    """The run's steps: ``--steps`` if given, else the task's epochs."""
    return getattr(args, "steps", None) or task.steps_per_epoch() * task.epochs


def train(key: str, task: Task, seed: int, args) -> dict:
    model, opt, clip = build(key, task, seed, total_steps(task, args), args)
    return fit(model, opt, clip, task, seed, args)


def eval_steps(per_epoch: int, total: int, args) -> set[int]:
    """The steps after which the metric is evaluated: every ``--eval-every`` steps, else
    ``args.evals`` times per epoch; with ``--steps`` (or ``--eval-every``) the last step too."""
    every = getattr(args, "eval_every", None)
    if every:
        return set(range(every, total + 1, every)) | {total}
    per = sorted({max(1, round(per_epoch * (j + 1) / args.evals)) for j in range(args.evals)})
    at = {e * per_epoch + j for e in range(-(-total // per_epoch)) for j in per if e * per_epoch + j <= total}
    return at | ({total} if getattr(args, "steps", None) else set())


def fit(model, opt, clip: float | None, task: Task, seed: int, args) -> dict:
    """Train ``model`` with ``opt`` (clipping the aggregate gradient to ``clip``) for the task's
    epochs (or the first ``args.steps`` steps) in the seed's data order, evaluating ``args.evals``
    times per epoch (or every ``args.eval_every`` steps). Seconds are training time only
    (``cpu_seconds``: this process's CPU time over the same steps, all its threads; ``step_seconds``
    and ``step_cpu``: each step's, where the start's one-off work shows); the evaluations' time is
    kept apart (``eval_seconds``). With ``args.diagnostics`` every step adds a record of
    :class:`Diagnostics` (one more collective per step, outside the timed part but its gradient
    hook)."""
    per_epoch = task.steps_per_epoch()
    total = total_steps(task, args)
    torch.manual_seed(seed * 7919 + task.rank)  # dropout: the same stream for every scheme
    evals = eval_steps(per_epoch, total, args)
    diag = Diagnostics(model, opt, task.size) if getattr(args, "diagnostics", False) else None
    records = []
    curve, densities, elapsed, cpu, evaluating, step, step_seconds, step_cpu = [], [], 0.0, 0.0, 0.0, 0, [], []
    for epoch in range(-(-total // per_epoch)):
        perm = task.order(seed, epoch)
        for i in range(min(per_epoch, total - step)):
            if diag is not None:
                diag.begin()
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            loss = task.loss(model, perm, i)
            loss.backward()
            if clip is not None and hasattr(opt, "synchronize"):  # Horovod's recipe: clip the aggregate
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                with opt.skip_synchronize():
                    opt.step()
            else:  # DDP's gradients are averaged by backward() already
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
            step_seconds.append(time.perf_counter() - t0)
            elapsed += step_seconds[-1]
            step_cpu.append(time.process_time() - c0)
            cpu += step_cpu[-1]
            step += 1
            stats = getattr(opt, "last_stats", None)
            if stats is not None:
                densities.append(stats.density)
            if diag is not None:
                records.append({"step": step, **diag.end(float(loss.detach()))})
            if step in evals:
                t0 = time.perf_counter()
                curve.append({"step": step, "seconds": elapsed, "metric": task.evaluate(model)})
                evaluating += time.perf_counter() - t0
    out = {"curve": curve, "final": curve[-1]["metric"], "seconds": elapsed, "steps": step,
           "cpu_seconds": cpu, "eval_seconds": evaluating, "density": float(np.mean(densities)) if densities else 1.0,
           "step_seconds": [round(s, 4) for s in step_seconds], "step_cpu": [round(s, 4) for s in step_cpu]}
    if diag is not None:
        diag.close()
        out["diagnostics"] = records
    return out


# ---- diagnostics (--diagnostics) ----------------------------------------------------------------
class Diagnostics:
    """Per-step error-feedback diagnostics of one run, as GLOBAL values: every rank adds its sums
    to one float64 tensor per step, summed with ``hvd.allreduce`` (the same collective on every
    rank, in the same order). A record (:meth:`end`) holds:

    * ``loss``: the training batch loss, mean over ranks.
    * ``grad_norm``: the norm of the LOCAL gradient (before synchronisation), RMS over ranks:
      ``sqrt(Σ_ranks ‖g‖² / ranks)``. A tensor hook (``Tensor.register_hook``) on each parameter
      sees the gradient as back-propagation produces it, before it is accumulated into ``.grad``
      and so before the optimizers' post-accumulate hooks (ours, Horovod's, DDP's) read it; it
      returns ``None`` and changes nothing.
    * ``update_norm``: ``‖x_after − x_before‖`` over all parameters (the same on every rank).
    * ``update_cosine``: the cosine between the descent the step applied (``x_before − x_after``)
      and the workers' mean local gradient of the step (one more collective: a dense
      ``hvd.allreduce`` of the local gradients), i.e. how much of the step points down this step's
      batch gradient; plain SGD scores 1.
    * ``momentum_cosine``: with ``momentum_correction=True``, the same cosine against the workers'
      mean local momentum ``u``, which is what a dense step would apply (one more allreduce);
      ``None`` otherwise.
    * ``momentum_norm``: RMS over ranks of the norm of the momentum the run holds: the wrapped
      SGD's ``momentum_buffer`` s (equal on every rank), or, with ``momentum_correction=True``,
      the plugin's local momentum ``u`` (per rank, of local gradients; read through
      ``opt.local_momentum``). ``None`` where neither exists.
    * ours only (an optimizer with ``residuals``), over the parameters that hold an error-feedback
      residual (those in the dense buffer of ``min_selected`` hold none and are left out):
      ``residual_norm`` (RMS over ranks of ``‖r‖``), ``residual_ratio`` (``residual_norm /
      grad_norm``), ``residual_age`` (``Σ|r|·age / Σ|r|`` over ranks, where ``age`` is a per-element
      counter: after each step +1 where ``r ≠ 0``, 0 where ``r == 0``, so an element sent leaves
      age 0 and mass held since k steps has age k), ``released_age`` (the age, before this step,
      of the elements sent this step — ``r`` zero after the step — weighted by what they sent,
      ``|r_before + e|``; ``e`` is the local gradient, or with momentum correction ``m·u_before +
      g`` (EF21-SGDM: ``g − (1 − m)·u_before``), weight decay and local clipping not counted;
      ``None`` if nothing was sent),
      ``released_residual_norm`` (RMS over ranks of the norm of ``r_before`` over the elements
      sent: the stale mass released this step), ``sent_fraction`` (``opt.last_stats.density``,
      mean over ranks), ``kept_energy`` (``Σ‖r_after‖² / Σ‖r_before + e‖²`` over ranks: the share of
      the pending energy that the selection left in the residual) and ``tensors``: per parameter that holds a residual, its
      ``residual_ratio`` (over its own local gradient's norm), ``residual_age`` and
      ``released_age``.
    """

    def __init__(self, model, opt, size: int) -> None:
        self.opt, self.size = opt, size
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.store = getattr(opt, "residuals", None)  # ours: names are model.named_parameters()'s
        self.mc = getattr(opt, "local_momentum", None)
        self.grad_sq, self.grads, self.tensor_sq = 0.0, {}, {}
        self.age: dict[str, torch.Tensor] = {}
        self.prev: dict[str, torch.Tensor] = {}    # r after the last step
        self.prev_u: dict[str, torch.Tensor] = {}  # momentum correction's u after the last step
        self.x0 = None
        self.handles = [p.register_hook(self._hook(n)) for n, p in self.named]

    def _hook(self, name: str):
        def hook(g: torch.Tensor) -> None:
            g = g.detach()
            g = g.to_dense() if g.is_sparse else g
            sq = float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2
            self.grad_sq += sq
            self.tensor_sq[name] = self.tensor_sq.get(name, 0.0) + sq
            flat = g.reshape(-1)
            self.grads[name] = flat.clone() if name not in self.grads else self.grads[name] + flat
            return None
        return hook

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).double() for _, p in self.named])

    def begin(self) -> None:
        """Before the step's backward: forget the last step's gradient, copy the parameters."""
        self.grad_sq, self.grads, self.tensor_sq = 0.0, {}, {}
        self.x0 = self._flat()

    def _momentum_sq(self) -> float | None:
        if self.mc is not None:
            return sum(float(torch.linalg.vector_norm(self.mc.momentum(n), dtype=torch.float64)) ** 2
                       for n, _ in self.named)
        state = getattr(self.opt, "state", {})
        bufs = [state[p].get("momentum_buffer") for _, p in self.named if p in state]
        bufs = [b for b in bufs if b is not None]
        if not bufs:
            return None
        return sum(float(torch.linalg.vector_norm(b, dtype=torch.float64)) ** 2 for b in bufs)

    #: per parameter: grad_sq, res_sq, res_abs_age, res_abs, rel_w_age, rel_w, rel_sq, pending_sq
    PER = 8

    def _residual_sums(self) -> list[list[float]]:
        """This rank's sums per parameter (:attr:`PER`, zeros for one without a residual), in the
        model's order (the same on every rank); the ages advanced."""
        out = []
        held = set(self.store.names()) | set(self.age)
        for name, p in self.named:
            sums = [self.tensor_sq.get(name, 0.0)] + [0.0] * (self.PER - 1)
            out.append(sums)
            if name not in held:
                continue
            r = self.store.peek(name)
            r = torch.zeros(p.numel(), dtype=p.dtype) if r is None else r.detach().reshape(-1)
            zero = torch.zeros_like(r)
            age = self.age.get(name, torch.zeros(r.numel(), dtype=torch.int32))
            before = self.prev.get(name, zero)
            e = self.grads.get(name, zero)
            if self.mc is not None:
                m = float(self.mc.factors(p)[0])  # EF21-SGDM adds u's increment, DGC's correction u
                e = e + (m - 1 if self.mc.increments else m) * self.prev_u.get(name, zero)
            w = (before + e).abs().double()
            sent = r == 0
            ws = torch.where(sent, w, torch.zeros_like(w))
            sums[4] += float((ws * age).sum())
            sums[5] += float(ws.sum())
            sums[6] += float(torch.where(sent, before, zero).double().pow(2).sum())
            sums[7] += float(w.pow(2).sum())
            age = torch.where(sent, torch.zeros_like(age), age + 1)
            a = r.abs().double()
            sums[1] += float(a.pow(2).sum())
            sums[2] += float((a * age).sum())
            sums[3] += float(a.sum())
            self.age[name], self.prev[name] = age, r.clone()
            if self.mc is not None:
                self.prev_u[name] = self.mc.momentum(name).detach().reshape(-1).clone()
        return out

    def end(self, loss: float) -> dict:
        """After the step: this step's record (a collective: every rank calls it at every step)."""
        step = self.x0 - self._flat()  # −Δx: the descent this step applied
        update = float(torch.linalg.vector_norm(step))
        ours = self.store is not None
        mean_grad = hvd.allreduce(torch.cat([self.grads[n].double() if n in self.grads
                                             else torch.zeros(p.numel(), dtype=torch.float64)
                                             for n, p in self.named]),
                                  op=hvd.Average, name="bench.diagnostics.grad")
        mean_norm = float(torch.linalg.vector_norm(mean_grad))
        align = float(step @ mean_grad) / (update * mean_norm) if update > 0 and mean_norm > 0 else None
        momentum_cosine = None
        if self.mc is not None:  # DGC's u: its mean over ranks is what a dense step would apply
            mean_u = hvd.allreduce(torch.cat([self.mc.momentum(n).detach().reshape(-1).double()
                                              for n, _ in self.named]),
                                   op=hvd.Average, name="bench.diagnostics.momentum")
            u_norm = float(torch.linalg.vector_norm(mean_u))
            momentum_cosine = float(step @ mean_u) / (update * u_norm) if update > 0 and u_norm > 0 else None
        per = self._residual_sums() if ours else []
        mom = self._momentum_sq()
        density = float(self.opt.last_stats.density) if ours else 0.0
        local = torch.tensor([loss, self.grad_sq, -1.0 if mom is None else mom, density, *sum(per, [])],
                             dtype=torch.float64)
        total = hvd.allreduce(local, op=hvd.Sum, name="bench.diagnostics").tolist()
        n = self.size
        loss, grad_sq, mom_sq, density = total[:4]
        grad_norm = (grad_sq / n) ** 0.5
        rec = {"loss": loss / n, "grad_norm": grad_norm, "update_norm": update,
               "update_cosine": align, "momentum_cosine": momentum_cosine,
               "momentum_norm": None if mom is None else (mom_sq / n) ** 0.5}
        if ours:
            rows = [total[4 + i * self.PER:4 + (i + 1) * self.PER] for i in range(len(self.named))]
            g_sq, res_sq, res_abs_age, res_abs, rel_w_age, rel_w, rel_sq, pending_sq = (sum(col) for col in zip(*rows))
            residual = (res_sq / n) ** 0.5
            rec.update(residual_norm=residual, residual_ratio=residual / grad_norm if grad_norm > 0 else None,
                       residual_age=res_abs_age / res_abs if res_abs > 0 else 0.0,
                       released_age=rel_w_age / rel_w if rel_w > 0 else None,
                       released_residual_norm=(rel_sq / n) ** 0.5, sent_fraction=density / n,
                       kept_energy=res_sq / pending_sq if pending_sq > 0 else None)
            rec["tensors"] = {name: {"residual_ratio": (row[1] / row[0]) ** 0.5 if row[0] > 0 else None,
                                     "residual_age": row[2] / row[3],
                                     "released_age": row[4] / row[5] if row[5] > 0 else None}
                              for (name, _), row in zip(self.named, rows) if row[3] > 0}
        return rec

    def close(self) -> None:
        for h in self.handles:
            h.remove()


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
    target = "none (no horovod run)" if s["target"] is None else (
        f"{s['target']:.4g} (dense median {s['dense']:.4g} {'−' if higher else '+'} "
        f"{QUALITY[model] * 100:g}{' points' if higher else ' %'})")
    print(f"\n{model}: {task_cls.metric}, {workers} workers, seeds {args.seeds}; quality target {target}")
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


def lag_steps(last: int) -> list[int]:
    """The steps of the lag table: 11, 22, 44 (those within the run) and the last."""
    return sorted({s for s in (11, 22, 44) if s < last} | {last})


def _at(records: list[dict], field: str, step: int, window: int = 1) -> float | None:
    """The mean of ``field`` over the ``window`` steps up to ``step`` (``None`` if none has it)."""
    vals = [r[field] for r in records if step - window < r["step"] <= step and r.get(field) is not None]
    return float(np.mean(vals)) if vals else None


def _nearest(curve: list[dict], step: int) -> float:
    """The metric of the evaluation nearest ``step`` (the earlier of two as near)."""
    return min(curve, key=lambda p: (abs(p["step"] - step), p["step"]))["metric"]


def _median(vals) -> float | None:
    vals = [v for v in vals if v is not None]
    return float(np.median(vals)) if vals else None


def lag_rows(runs: dict) -> dict:
    """Per step of :func:`lag_steps` and scheme: medians over seeds of the test metric (nearest
    evaluation), the loss (mean of the 5 steps up to the step), the residual's ratio and age, the
    released age and stale norm (over the gradient norm), and per seed the update's and
    momentum's norms over Horovod's at the same step (same seed), median of the ratios."""
    last = max(len(r["diagnostics"]) for by_seed in runs.values() for r in by_seed.values())
    dense = runs.get("horovod", {})
    out = {}
    for step in lag_steps(last):
        rows = {}
        for key, by_seed in runs.items():
            def ratio(field):
                return _median([(_at(r["diagnostics"], field, step) / _at(dense[s]["diagnostics"], field, step))
                                if s in dense and _at(r["diagnostics"], field, step) is not None
                                and _at(dense[s]["diagnostics"], field, step) else None
                                for s, r in by_seed.items()])

            def med(field, window=1):
                return _median([_at(r["diagnostics"], field, step, window) for r in by_seed.values()])

            rows[key] = {"metric": _median([_nearest(r["curve"], step) for r in by_seed.values()]),
                         "loss5": med("loss", 5), "grad_norm": med("grad_norm"),
                         "residual_ratio": med("residual_ratio"), "residual_age": med("residual_age"),
                         "released_age": med("released_age"),
                         "released_over_grad": _median([
                             _at(r["diagnostics"], "released_residual_norm", step) / _at(r["diagnostics"], "grad_norm", step)
                             if _at(r["diagnostics"], "released_residual_norm", step) is not None
                             and _at(r["diagnostics"], "grad_norm", step) else None for r in by_seed.values()]),
                         "sent": med("sent_fraction"), "kept": med("kept_energy"),
                         "cosine": med("update_cosine", 5),
                         "update_vs_dense": ratio("update_norm"), "momentum_vs_dense": ratio("momentum_norm")}
        out[step] = rows
    return out


def print_lag_table(model: str, task_cls, rows: dict, args, workers: int) -> None:
    def f(v, fmt):
        return "—" if v is None else format(v, fmt)

    print(f"\n{model}: error-feedback diagnostics, {workers} workers, seeds {args.seeds}, medians over seeds. "
          f"metric: {task_cls.metric} at the nearest evaluation; loss: mean of the 5 steps up to the step; "
          "res/g: residual norm / local gradient norm; age: |r|-weighted mean age of the residual (steps); "
          "rel age: |sent|-weighted age of what was sent; rel/g: norm of the stale residual released / gradient "
          "norm; kept: share of the pending energy kept in the residual; cos: cosine of the update with the "
          "workers' mean gradient (mean of the 5 steps up to the step); upd/hvd, mom/hvd: update and momentum "
          "norm over Horovod's at the same step (same seed)")
    print(f"{'step':>4} {'scheme':<20} {'metric':>7} {'loss':>6} {'grad':>6} {'res/g':>6} {'age':>5} {'rel age':>7} "
          f"{'rel/g':>6} {'sent':>6} {'kept':>5} {'cos':>5} {'upd/hvd':>7} {'mom/hvd':>7}")
    for step, by_key in rows.items():
        for key, r in by_key.items():
            print(f"{step:>4} {key:<20} {f(r['metric'], '.4f'):>7} {f(r['loss5'], '.3f'):>6} "
                  f"{f(r['grad_norm'], '.3f'):>6} {f(r['residual_ratio'], '.2f'):>6} {f(r['residual_age'], '.2f'):>5} "
                  f"{f(r['released_age'], '.2f'):>7} {f(r['released_over_grad'], '.2f'):>6} {f(r['sent'], '.4f'):>6} "
                  f"{f(r['kept'], '.2f'):>5} {f(r['cosine'], '.2f'):>5} "
                  f"{f(r['update_vs_dense'], '.2f'):>7} {f(r['momentum_vs_dense'], '.2f'):>7}")


def plot_lag(model: str, task_cls, runs: dict, path: str) -> None:
    """Four panels against the step, one line per scheme (median over seeds): the test metric,
    the residual's norm over the gradient's, the residual's age, the update's norm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    panels = [("metric", f"{task_cls.metric}"), ("residual_ratio", "residual norm / gradient norm"),
              ("residual_age", "residual age (|r|-weighted, steps)"), ("update_norm", "update norm ‖Δx‖")]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (field, title) in zip(axes.flat, panels):
        for n, (key, by_seed) in enumerate(runs.items()):
            style = dict(label=key, color="black" if key == "horovod" else colours[n % len(colours)],
                         lw=2 if key == "horovod" else 1.2, ls="--" if "+" in key else "-")
            if field == "metric":
                curves = [r["curve"] for r in by_seed.values()]
                ax.plot([p["step"] for p in curves[0]], np.median([[p["metric"] for p in c] for c in curves], axis=0),
                        marker=".", ms=3, **style)
                continue
            recs = [r["diagnostics"] for r in by_seed.values()]
            if any(x.get(field) is None for rec in recs for x in rec):
                continue
            ax.plot([x["step"] for x in recs[0]], np.median([[x[field] for x in rec] for rec in recs], axis=0), **style)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[1, 1].set_yscale("log")
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{model}: error feedback against the step (median over seeds)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main ---------------------------------------------------------------------------------------
#: The options of the training itself (the tasks' length, evaluation and warm-up), which
#: ``bench_time_to_accuracy`` passes on to its workers.
TRAINING_ARGS = ("digits_epochs", "digits_width", "digits_lr", "lstm_epochs", "lstm_lr", "lstm_clip", "evals",
                 "valid_tokens", "warmup_fraction")


def add_training_args(ap: argparse.ArgumentParser) -> None:
    """The options of :data:`TRAINING_ARGS`."""
    ap.add_argument("--digits-epochs", type=int, default=8)
    ap.add_argument("--digits-width", type=int, default=32,
                    help="digits: the CNN's width (32: 61 k weights; 64: 145 k, as examples/train_digits.py)")
    ap.add_argument("--digits-lr", type=float, default=0.05, help="digits: the SGD's learning rate (not scaled "
                    "by the worker count; examples/train_digits.py uses 0.02 × workers)")
    ap.add_argument("--lstm-epochs", type=int, default=2)
    ap.add_argument("--lstm-lr", type=float, default=3.2, help="lstm: the SGD's learning rate (0.5 before "
                    "2026-11-29, far below dense's best)")
    ap.add_argument("--lstm-clip", type=float, default=0.25, help="lstm: the norm the aggregate gradient is "
                    "clipped to after synchronize(), as Horovod users do (0: no clip)")
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
    ap.add_argument("--min-selected", type=int, help="our schemes' min_selected (default: the optimizer's)")
    ap.add_argument("--steps", type=int, help="train only the first N steps (overrides the epochs)")
    ap.add_argument("--eval-every", type=int, help="evaluate every K steps (default: --evals per epoch)")
    ap.add_argument("--diagnostics", action="store_true",
                    help="record error-feedback diagnostics at every step (see Diagnostics): a table per "
                         "model, lag_{model}.png and the records in results.json")
    ap.add_argument("--out", default="out/bench_convergence")
    args = ap.parse_args()
    for name in ("steps", "eval_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    keys = args.schemes or scheme_keys(args)
    for k in keys:
        resolve(k)  # a malformed key stops here, before Horovod starts

    import horovod_safusion  # noqa: F401  before hvd.init(), as a user's script: this job runs ours too
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    import torch.distributed as dist
    port = hvd.broadcast_object(free_port() if rank == 0 else None, root_rank=0, name="bench.port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    results = {}
    t_start = time.time()
    for model in args.models:
        task = TASKS[model](args, rank, size, horovod_sum)
        if rank == 0:
            steps = total_steps(task, args)
            print_resolved([describe(sc, our_kwargs(sc, task, steps, args) if sc.ours else None)
                            for sc in map(resolve, keys)], f"{model}: schemes, as resolved")
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
                          "steps": total_steps(task, args),
                          "params": sum(p.numel() for p in task.model().parameters())}
        if rank == 0:  # each model's table and files as soon as it is done
            print_table(model, TASKS[model], results[model]["summary"], args, size)
            os.makedirs(args.out, exist_ok=True)
            plot(model, TASKS[model], runs, os.path.join(args.out, f"convergence_{model}.png"))
            if args.diagnostics:
                results[model]["lag"] = lag_rows(runs)
                print_lag_table(model, TASKS[model], results[model]["lag"], args, size)
                plot_lag(model, TASKS[model], runs, os.path.join(args.out, f"lag_{model}.png"))
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump({"args": vars(args), "workers": size, "torch": torch.__version__,
                           "minutes": (time.time() - t_start) / 60, "results": results}, f, indent=1)
    if rank == 0:
        print(f"\n{(time.time() - t_start) / 60:.1f} minutes; wrote {args.out}/results.json and "
              f"convergence_*.png" + (" and lag_*.png" if args.diagnostics else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
