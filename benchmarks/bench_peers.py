"""SAFusion against what a user would pick instead, each run the way its users run it.

    python benchmarks/bench_peers.py [--links loopback 1gbit 200mbit] [--models resnet18 lstm]
                                     [--schemes ...] [--alternations 5 --steps 3]

Peers (each a key in the results):

    compute        every worker runs forward/backward/SGD step, no communication (the limit)
    horovod        hvd.DistributedOptimizer (dense allreduce, Horovod's Tensor Fusion)
    horovod-fp16   the same with compression=hvd.Compression.fp16
    ddp            torch DistributedDataParallel, gloo backend, its default buckets (25 MB)
    ddp-powersgd   DDP with PyTorch's PowerSGD comm hook, rank 4, compressing from iteration 2,
                   DDP's default buckets
    safusion       horovod_safusion.DistributedOptimizer(opt, named_parameters=...) with no other
                   arguments (the user's default; only ``profile_steps`` is passed, and only when
                   ``--profile-steps`` differs from the library default)
    wfbp           the same with fusion="wfbp" (one buffer per tensor)
    safusion@0.001 the default at density=0.001

``--schemes`` picks a subset and adds variants, each a label of :mod:`schemes`' one grammar
(``fusion[@density][/compressor][+technique...][:key=value...]``; a key in capitals, such as
``HOROVOD_CYCLE_TIME=5``, is an environment variable of that job's launcher and workers, for any
scheme): ``safusion@0.01/topk`` and ``safusion:compressor=topk:density=0.01`` name the same
scheme. The whole label is the scheme's key
in the results; the driver prints what each resolved to before the first job.

Models: ``resnet18`` (CIFAR ResNet-18, width 64: 11.2 M weights in 62 tensors; batch 16/worker of
fixed random 3×32×32 images, SGD lr 0.01 momentum 0.9) and ``lstm`` (word-level 2-layer LSTM
language model, 650 units, vocabulary 10000: 19.8 M weights, mostly the embedding and decoder;
16 sequences × 35 tokens/worker of the Python standard library's source, see
``examples/corpus.py``; SGD lr 0.1 momentum 0.9; no clipping).

Method. Every scheme runs in a job of its own per link and model, started by its users' launcher:
``compute``, ``ddp`` and ``ddp-powersgd`` by ``python -m torch.distributed.run --nproc_per_node N``
(``torch.distributed`` gloo group; ``compute`` uses it only for the benchmark's barriers), Horovod's
schemes and ours by ``horovodrun -np N --gloo`` (``hvd.init()``, no ``torch.distributed``). Each
worker runs 1 thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``). A link is
``loopback`` as is, or a tc rate such as ``1gbit`` inside a fresh network namespace whose loopback
is limited (``links.py``; needs root); all of a link's jobs run in its one namespace. Per model,
the driver starts the jobs one at a time. Each builds its model (same seed; Horovod's schemes
broadcast rank 0's weights, DDP broadcasts itself) and optimizer and warms up (our optimizers for
``profile_steps + 3`` steps and on until they have settled: profile, plan, a plan trial, steady
state; PowerSGD past its start iteration plus 2 steps; the rest 3), then its workers report
``warm`` and wait; the driver stops them (``SIGSTOP`` to the worker processes, not the launchers)
before it starts the next job. A stopped job uses no CPU. A warm Horovod job left running, idle
between turns, used 0.11 CPU s per second per worker at loopback and 0.14 at 200mbit here
(Horovod's background thread keeps cycling; an idle DDP job used 0.01, the workers' own polling),
so the default schemes' five Horovod jobs would take over a core of the two from the job being
measured. Then ``--alternations`` rounds: in each, every job in turn is continued (``SIGCONT``)
and told its round; its workers run 1 untimed step, a barrier, and ``--steps`` timed steps, write
their samples, and the driver stops the job again. The order is fixed but the starting scheme
rotates each round, so drift and order effects spread over all schemes. Where the warm jobs would
not fit in memory at once (many hosts: a job holds P workers), compute and ours stay warm and the
other schemes run in groups beside them, each group its own alternations (``--resident``; the
group size comes from the references' measured peak memory and the memory available), so each
ratio still compares schemes of the same rounds. The driver and the workers talk through files in
``--out``/ctl/<link>-<model>-<scheme>/ (the workers' pids, ``warm``, the round to run, the samples;
workers poll every 10 ms); each job's output goes to ``--out``/logs/<link>-<model>-<scheme>.log.
A job stays stopped for minutes while the others run, and a collective in flight when it was
stopped (Horovod's background thread, negotiating all the time, may have one) resumes after it: so the collectives'
timeouts are long, 2 hours (``HOROVOD_GLOO_TIMEOUT_SECONDS`` for Horovod's jobs,
``init_process_group(timeout=...)`` for torchrun's), which bounds how long one job may stay
stopped. With Horovod's default (30 s) a job stopped for 60 s died ("Timed out waiting 30000ms
for recv operation"); with 2 hours, Horovod's and DDP's jobs resumed after 90 s stops at loopback
and at 200mbit. torchrun's agent, which is not stopped, only polls whether its workers exited.

A job that exits, loses a worker, or gives no sample within max(120 s, 10 × (steps + 1) × its
warm-up step time) of being told its round (or is not warm within ``--timeout`` s) is killed
with everything it started and reported as failed, with the meaningful line of its log (its
workers' first error, or how a worker ended); the other schemes go on, and no ratio is taken
against it. A failed job's samples so far stay in results.json. PowerSGD's hook starts its 2nd
and 3rd allreduce from completion callbacks; with several buckets Gloo ranks may start them in
different orders (an earlier version saw ``op.preamble.length <= op.nbytes`` abort a job); if
that happens, ``ddp-powersgd`` is reported so. With several ``--hosts``, a scheme that failed at
a smaller number of hosts on the same model and link is not launched again at the larger ones
(each start of a job of 8 workers costs minutes here): its cells say "not launched: failed at
<setting> (<reason>)"; ``--relaunch-failed`` launches it anyway.

Per scheme and round: seconds/iteration (the slowest rank), CPU seconds/iteration per worker
(``time.process_time``, mean of ranks) and its split by thread from ``/proc/self/task/*/stat``: the
main thread (``training``: forward, backward, sparsification, the step) and all ``other threads``
(Horovod's background thread, Gloo's loops). CPU time counts waiting that spins: Horovod's wait for
its allreduces keeps the main thread busy (at 200mbit its training thread used 3.7 CPU s of a 3.8 s
iteration), so for slow dense peers it measures the wait too. The report gives medians with
min–max over rounds, the scaling factor (median of per-round compute-time / scheme-time) and
safusion's speedups (median of per-round ``peer s/it / safusion s/it``; >1: we are faster) against
each peer and against the best dense one of that round. Wall time on these shared 2-core machines
moves by up to 2x between runs, so only per-round ratios and CPU seconds are worth comparing; CPU
seconds drift far less. Raw per-rank, per-round samples, failures and the summary go to
``--out``/results.json, the bars to ``--out``/bench_peers.png.

``--pin`` (default on) pins worker r to core ``r % cores`` (all its threads, so Horovod's and
Gloo's threads share their worker's core). It made runs steadier here: loopback, ResNet-18, 2
workers on 2 cores shared with another user's jobs, 4 alternations x 2 steps, two pairs of runs
in both orders — compute alone 0.756 s/it [0.702–0.792] and 0.765 [0.649–0.879] pinned against
1.278 [1.100–2.826] and 1.064 [0.776–1.398] unpinned; horovod 0.836 [0.813–0.966] and 0.833
[0.728–1.074] pinned, 1.679 [1.434–2.509] and 2.125 [1.413–2.807] unpinned. Pinned, wall time
comes close to CPU time (0.66–0.71 CPU s/it for compute): the two workers stop taking turns on
the same core. ``--no-pin`` when the workers outnumber the cores or other jobs are pinned.

Memory per worker and scheme, the worst rank, of the job's own processes: ``steady`` is the
resident set (``VmRSS`` with the allocator's free memory handed back) after build and warm-up,
``peak`` the highest resident set (``VmHWM``) over the whole job, start to last round; ``+steady``
and ``+peak`` are their differences to ``compute``'s job, what the scheme costs over training
alone (its launcher's library included: Horovod in Horovod's jobs and ours, ``torch.distributed``
only in torchrun's); ``rise`` is the largest rise of the resident set within a round's timed
steps; ``held`` is what our optimizer holds in its own tensors
(:func:`horovod_safusion.memory.held`), in multiples of the model's weights. All of a model's jobs
live at once (stopped), so the machine holds their sum: with many workers on a small machine run
``--models`` one at a time or fewer schemes.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples")
sys.path.insert(0, HERE)
from links import INTERFACE, LOOPBACK, check_link, cluster, job_environ, kill_tree, launchers, limited_link, start_job  # noqa: E402
from schemes import TORCHRUN, Scheme, describe, parse, print_resolved  # noqa: E402

DEFAULT_SCHEMES = ("compute", "horovod", "horovod-fp16", "ddp", "ddp-powersgd", "safusion", "wfbp", "safusion@0.001")
DENSE = ("horovod", "horovod-fp16", "ddp")
VS = ("horovod", "horovod-fp16", "ddp", "ddp-powersgd")
MODELS = ("resnet18", "lstm")
DENSE_WARMUP = 3  # steps for the peers' first iterations (allocation, DDP's bucket rebuild)
POWERSGD_START = 2  # PowerSGD's start_powerSGD_iter
COLLECTIVE_TIMEOUT_S = 7200  # Gloo's timeout in every job: a job stays stopped while the others run
POLL_S = 0.01  # how often a waiting worker looks for its next order
MIN_TURN_TIMEOUT_S = 120.0
QUIT_TIMEOUT_S = 120.0  # for a job to exit once told to


# ---- schemes ----------------------------------------------------------------------------------
def kind_of(scheme: Scheme) -> str:
    """How the job builds and launches ``scheme``: the peer's name, or ``"saf"`` for ours."""
    return scheme.peer or "saf"


# ---- the control directory (both sides) -------------------------------------------------------
class Control:
    """A job's control directory: the files through which the driver and the job's workers talk.

    Workers write ``pid.<rank>``, ``warm.<rank>`` and ``sample.<round>.<rank>``; the driver writes
    ``go`` (a round number, or ``"quit"``). Every file is JSON written whole (a temporary file
    renamed), so neither side reads half a file.
    """

    def __init__(self, path: str):
        self.path = path

    def reset(self) -> None:
        """Start empty (files of an earlier run would read as this one's)."""
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path)

    def write(self, name: str, obj) -> None:
        tmp = os.path.join(self.path, f".{name}.tmp")
        with open(tmp, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, os.path.join(self.path, name))

    def read(self, name: str):
        """The object in file ``name``, or None if there is none yet."""
        try:
            with open(os.path.join(self.path, name)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def has(self, names: list[str]) -> bool:
        return all(os.path.exists(os.path.join(self.path, n)) for n in names)

    def next_round(self, done: int) -> int | None:
        """(Worker) wait for a round after ``done``; None when told to quit."""
        while True:
            order = self.read("go")
            if order == "quit":
                return None
            if isinstance(order, int) and order > done:
                return order
            time.sleep(POLL_S)


# ---- worker -----------------------------------------------------------------------------------
def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of every thread of this process: tid -> (comm, seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def thread_delta(before: dict, after: dict) -> tuple[float, float, dict[str, float]]:
    """(main thread s, other threads s, other threads s by name) between two ``thread_cpu()``."""
    pid, main, other, by = os.getpid(), 0.0, 0.0, {}
    for tid, (comm, s) in after.items():
        d = s - before.get(tid, (comm, 0.0))[1]
        if tid == pid:
            main += d
        else:
            other += d
            by[comm] = by.get(comm, 0.0) + d
    return main, other, by


def memory_module():
    """``horovod_safusion.memory`` (resident set, peaks, held bytes) loaded from its file without
    the package's ``__init__``, which imports Horovod: the torchrun jobs must not load it."""
    package = importlib.util.find_spec("horovod_safusion")  # finds the package, runs nothing
    spec = importlib.util.spec_from_file_location(
        "bench_peers_memory", os.path.join(os.path.dirname(package.origin), "memory.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


class Run:
    """One scheme of one model in one worker: its model, optimizer, data and step counter."""

    def __init__(self, kind, model, opt, data, loss_fn, warmup):
        self.kind, self.model, self.opt, self.data, self.loss_fn = kind, model, opt, data, loss_fn
        self.warmup, self.step_no = warmup, 0

    def step(self) -> None:
        x, y = self.data(self.step_no)
        self.step_no += 1
        self.opt.zero_grad()
        self.loss_fn(self.model(x), y).backward()
        self.opt.step()

    def warm_up(self) -> list[float]:
        """The warm-up steps, and on until our optimizer has settled; each one's seconds."""
        times = []
        while len(times) < self.warmup or not getattr(self.opt, "settled", True):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        return times


def make_task(name: str, rank: int, size: int, args):
    """(model factory, data(step) -> (x, y), loss, lr) for model ``name``."""
    import torch
    import torch.nn.functional as F
    from models import LSTMLanguageModel, resnet18

    g = torch.Generator().manual_seed(args.seed + 1000 + rank)
    if name == "resnet18":
        x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (args.batch_size,), generator=g)
        return (lambda: resnet18(num_classes=10, in_channels=3, width=args.width)), (lambda step: (x, y)), \
            F.cross_entropy, 0.01
    if name == "lstm":
        from corpus import stdlib_corpus
        ids, itos = stdlib_corpus(vocab=args.vocab)
        bptt, n = args.bptt, len(ids)
        span = torch.arange(bptt)

        def data(step):  # this rank's batch: batch_size consecutive windows, ranks side by side
            first = (step * size + rank) * args.batch_size
            starts = ((first + torch.arange(args.batch_size)) * bptt) % (n - bptt - 1)
            idx = starts[:, None] + span
            return ids[idx], ids[idx + 1]

        def loss(logits, target):
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())

        return (lambda: LSTMLanguageModel(len(itos), embed=args.hidden, hidden=args.hidden)), data, loss, 0.1
    raise SystemExit(f"--models {name}: unknown model; known: {', '.join(MODELS)}")


def ours_kwargs(scheme: Scheme, args) -> dict:
    """Our optimizer's arguments for ``scheme``: its label's, plus ``profile_steps`` where
    ``--profile-steps`` differs from the library's default (a warm-up technique covers
    :data:`DENSE_WARMUP` steps)."""
    defaults = {"profile_steps": args.profile_steps} if args.profile_steps != default_profile_steps() else {}
    return scheme.kwargs(warmup_steps=DENSE_WARMUP, defaults=defaults)


def default_profile_steps() -> int:
    import inspect
    import horovod_safusion as saf

    return inspect.signature(saf.DistributedOptimizer).parameters["profile_steps"].default


def build(scheme: Scheme, make_model, data, loss_fn, lr: float, args) -> Run:
    """The model and optimizer of one scheme, ready for its warm-up."""
    import torch
    from schemes import ddp_powersgd, horovod_optimizer, our_optimizer

    kind = kind_of(scheme)
    torch.manual_seed(args.seed)
    model = make_model()
    sgd = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    warmup = DENSE_WARMUP
    if kind == "compute":
        opt = sgd(model.parameters())
    elif kind in ("ddp-powersgd", "ddp-powersgd-1bucket"):
        model = ddp_powersgd(model, start_iter=POWERSGD_START, one_bucket=kind == "ddp-powersgd-1bucket")
        warmup = POWERSGD_START + 2  # past the start iteration, compressing for 2 steps
        opt = sgd(model.parameters())
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
        opt = sgd(model.parameters())
    elif kind in ("horovod", "horovod-fp16"):
        opt = horovod_optimizer(scheme, sgd(model.parameters()), model)
    else:
        kwargs = ours_kwargs(scheme, args)
        opt = our_optimizer(sgd(model.parameters()), model, kwargs)
        warmup = kwargs.get("profile_steps", default_profile_steps()) + 3  # 1 warm-up + profile, re-plan, 2 more
    return Run(kind, model, opt, data, loss_fn, warmup)


def saf_info(opt) -> dict:
    """What our optimizer planned and sent last (best effort: only what the optimizer exposes)."""
    info = {}
    plan = getattr(opt, "plan", None)
    if plan is not None and hasattr(plan, "buffers"):
        info["buffers"] = len(plan.buffers)
        info["planner"] = getattr(plan, "planner", None)
        info["dense"] = bool(getattr(plan, "dense", False))
        info["communicator"] = getattr(getattr(opt, "communicator", None), "name", None)
        meta = getattr(plan, "meta", {})
        info["predicted_s"] = meta.get("predicted_iteration_s")
        info["predicted_options_s"] = meta.get("predicted_options_s")
    st = getattr(opt, "last_stats", None)
    if st is not None:
        for k in ("bytes_sent", "bytes_received", "selected", "elements", "missing", "tensors"):
            if hasattr(st, k):
                info[k] = int(getattr(st, k))
    return info


def profile_of(opt) -> dict | None:
    """Our optimizer's profile as JSON data (``None`` where it has none, or a version without one)."""
    profile = getattr(opt, "profile", None)
    return profile.to_dict() if profile is not None and hasattr(profile, "to_dict") else None


def pin_threads(rank: int) -> int | None:
    """Pin every thread of this process (and so the threads it starts later) to one core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:
            pass
    return core


def join(kind: str) -> tuple[int, int, Callable[[], None], Callable[[], None]]:
    """(rank, size, barrier, leave) of this worker's job: ``torch.distributed`` (gloo, set up by
    torchrun's environment) for compute and DDP's schemes, Horovod for Horovod's and ours."""
    import torch

    if kind in TORCHRUN:
        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        return (dist.get_rank(), dist.get_world_size(), lambda: dist.all_reduce(torch.zeros(1)),
                dist.destroy_process_group)
    import horovod.torch as hvd
    if kind == "saf":
        import horovod_safusion  # noqa: F401  imported before hvd.init(), as at the top of a user's script
    hvd.init()
    return (hvd.rank(), hvd.size(), lambda: hvd.allreduce(torch.zeros(1), name="bench_peers.barrier"),
            hvd.shutdown)


#: Bytes this worker's host received (a host of a cluster on one machine: one worker per host).
RX_BYTES = "/sys/class/net/sfnet/statistics/rx_bytes"


def received() -> int | None:
    """The host's received bytes so far, or None outside a cluster's host."""
    try:
        with open(RX_BYTES) as f:
            return int(f.read())
    except OSError:
        return None


def timed_turn(run: Run, rnd: int, barrier: Callable[[], None], memory, steps: int) -> dict:
    """One round of one scheme in this worker: 1 untimed step, a barrier, ``steps`` timed steps."""
    run.step()  # untimed: back from the stop
    barrier()
    rx0 = received()
    peak_before = memory.rss()["hwm"]  # the peak since the last turn's timed steps (or the start)
    memory.reset_peak()
    base = memory.rss()["rss"]
    th0, c0, t0 = thread_cpu(), time.process_time(), time.perf_counter()
    for _ in range(steps):
        run.step()
    wall = (time.perf_counter() - t0) / steps
    cpu = (time.process_time() - c0) / steps
    main, other, by = thread_delta(th0, thread_cpu())
    hwm = memory.rss()["hwm"]
    rx1 = received()
    sample = {"round": rnd, "wall": wall, "cpu": cpu, "training": main / steps, "other": other / steps,
              "threads": {k: v / steps for k, v in by.items()},
              "rise": hwm - base, "peak": max(peak_before, hwm),
              "received": None if rx0 is None or rx1 is None else (rx1 - rx0) / steps}
    if run.kind == "saf":
        sample["saf"] = saf_info(run.opt)
    return sample


def worker(args) -> None:
    """One worker of one job: build, warm up, report warm, then run the rounds the driver orders."""
    import torch

    scheme = parse(args.schemes[0])
    kind = kind_of(scheme)
    ctl = Control(args.job_dir)
    torch.set_num_threads(1)
    rank, size, barrier, leave = join(kind)
    ctl.write(f"pid.{rank}", os.getpid())
    core = pin_threads(rank) if args.pin else None
    memory = memory_module()
    make_model, data, loss_fn, lr = make_task(args.models[0], rank, size, args)
    run = build(scheme, make_model, data, loss_fn, lr, args)
    times = run.warm_up()
    weights = list(run.model.parameters())
    ctl.write(f"warm.{rank}", {
        "pid": os.getpid(), "core": core, "size": size, "torch": torch.__version__,
        "params": sum(p.numel() for p in weights), "model_bytes": sum(p.numel() * p.element_size() for p in weights),
        "warmup_steps": len(times), "step_time": float(np.median(times[-DENSE_WARMUP:])),
        "steady": memory.resident(), "hwm": memory.rss()["hwm"],
        "held": memory.held(run.opt).bytes if kind == "saf" else None,
        # the profile our optimizer planned from, for the simulator's calibration (bench_scale)
        "profile": profile_of(run.opt) if kind == "saf" and rank == 0 else None})
    print(f"rank {rank}: warm after {len(times)} steps, last {times[-1]:.3f} s", flush=True)
    done = -1
    while (rnd := ctl.next_round(done)) is not None:
        ctl.write(f"sample.{rnd}.{rank}", timed_turn(run, rnd, barrier, memory, args.steps))
        done = rnd
    leave()


# ---- driver: jobs -----------------------------------------------------------------------------
@dataclasses.dataclass
class Job:
    """One scheme's job at one link and model, as the driver sees it."""

    key: str
    kind: str
    ctl: Control
    log: str
    workers: int
    procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)  # its launchers
    pids: list[int] = dataclasses.field(default_factory=list)
    warm: list[dict] = dataclasses.field(default_factory=list)
    turn_timeout: float = MIN_TURN_TIMEOUT_S
    failed: str | None = None

    def files(self, kind: str, rnd: int | None = None) -> list[str]:
        """Every rank's file ``<kind>.<rank>``, or ``<kind>.<rnd>.<rank>`` for round ``rnd``."""
        return [f"{kind}.{r}" if rnd is None else f"{kind}.{rnd}.{r}" for r in range(self.workers)]


def slug(text: str) -> str:
    """``text`` as a file name."""
    return re.sub(r"[^\w.=-]+", "_", text)


def commands(job: Job, model: str, args, prefix: list[str]) -> list[list[str]]:
    """The job's launcher commands (:func:`links.launchers`): torchrun for compute and DDP's
    schemes, horovodrun for the rest, under ``prefix`` or on ``args.on_hosts`` hosts of a cluster."""
    worker_cmd = [os.path.abspath(__file__), "--worker", "--job-dir", job.ctl.path, "--models", model,
                  "--schemes", job.key, "--pin" if args.pin else "--no-pin",
                  *sum(([f"--{k.replace('_', '-')}", str(getattr(args, k))] for k in WORKER_ARGS), [])]
    return launchers(worker_cmd, job.kind in TORCHRUN, args.np, args.on_hosts, prefix)


def launch(job: Job, cmds: list[list[str]]) -> None:
    """Start the job's launchers, each in a session of its own, their output to the job's log."""
    env = job_environ(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **parse(job.key).env)
    if job.kind not in TORCHRUN:
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(COLLECTIVE_TIMEOUT_S)
    elif len(cmds) > 1:
        env["GLOO_SOCKET_IFNAME"] = INTERFACE  # torch's gloo group over the hosts' own interface
    job.ctl.reset()
    with open(job.log, "w") as log:
        for cmd in cmds:
            log.write(" ".join(cmd) + "\n")
        log.flush()
        job.procs = start_job(cmds, log, env)


#: A worker's own error (an exception, Gloo's abort), then what a launcher says of a worker's end.
WORKER_ERROR = re.compile(r"what\(\)|\w(Error|Exception)\b.*:|enforce fail|Timed out")
WORKER_END = re.compile(r"signal|killed|abort|exit ?code", re.I)
LAUNCHER_REPORT = re.compile(r"ChildFailedError|Horovod detected that one or more processes|To enable traceback")


def last_words(log: str, width: int = 200) -> str:
    """The meaningful line of a job's log: its workers' first error (the cause; later ones tend to
    be its echoes on the other ranks), or else the last line on how a worker ended, or "no error
    in its log"."""
    with open(log, errors="replace") as f:
        f.seek(max(0, os.path.getsize(log) - 65536))
        lines = [re.sub(r"^\[\d+\]<std(out|err)>:|^\[rank\d+\]:", "", line).strip() for line in f.read().splitlines()]
    lines = [line for line in lines if not LAUNCHER_REPORT.search(line)]
    errors = [line for line in lines if WORKER_ERROR.search(line)]
    ends = [line for line in lines if WORKER_END.search(line)]
    line = errors[0] if errors else ends[-1] if ends else "no error in its log"
    line = re.sub(r"\[[^]]*/[^]]*\]\s*", "", line)  # [source paths and lines] of C++ messages
    return line if len(line) <= width else line[:width - 1] + "…"


def fail(job: Job, why: str) -> None:
    """Kill the job and mark it failed, with the reason and the meaningful line of its log."""
    kill_tree(job.procs, job.pids)
    job.failed = f"{why} ({last_words(job.log)})"


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def trouble(job: Job) -> str | None:
    """Why the job cannot go on (its launcher exited, or a worker it reported is gone), or None."""
    rc = next((rc for rc in (p.poll() for p in job.procs) if rc is not None), None)
    if rc is not None:
        return f"exit status {rc}"
    gone = [f"rank {r} (pid {pid})" for r, pid in enumerate(job.pids) if not alive(pid)]
    return f"worker {', '.join(gone)} gone" if gone else None


def await_files(job: Job, names: list[str], timeout: float, what: str) -> bool:
    """Wait until the job's workers have written ``names``. False, and the job failed, when it is
    in trouble or ``timeout`` s pass first."""
    deadline = time.monotonic() + timeout
    while not job.ctl.has(names):
        why = trouble(job) or (f"nothing within {timeout:.0f} s" if time.monotonic() > deadline else None)
        if why:
            fail(job, f"{why} {what}")
            return False
        time.sleep(0.05)
    return True


def signal_workers(job: Job, sig: signal.Signals, what: str) -> bool:
    """Send ``sig`` to the job's workers (not its launcher); False, and the job failed, if it is in
    trouble."""
    why = trouble(job)
    for pid in job.pids if why is None else []:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            why = f"worker pid {pid} gone"
            break
    if why:
        fail(job, f"{why} {what}")
    return why is None


def warm_up(job: Job, cmds: list[list[str]], args) -> None:
    """Start the job, wait until its workers are warm, and stop them."""
    launch(job, cmds)
    if not await_files(job, job.files("warm"), args.timeout, "while warming up"):
        return
    job.warm = [job.ctl.read(name) for name in job.files("warm")]
    job.pids = [w["pid"] for w in job.warm]
    step_time = max(w["step_time"] for w in job.warm)
    job.turn_timeout = max(MIN_TURN_TIMEOUT_S, 10 * (args.steps + 1) * step_time)
    signal_workers(job, signal.SIGSTOP, "after warming up")


def take_turn(job: Job, rnd: int) -> None:
    """Continue the job, have it run round ``rnd``, wait for every rank's sample, stop it again."""
    if signal_workers(job, signal.SIGCONT, f"before round {rnd}"):
        job.ctl.write("go", rnd)
        if await_files(job, job.files("sample", rnd), job.turn_timeout, f"in round {rnd}"):
            signal_workers(job, signal.SIGSTOP, f"after round {rnd}")


def finish(jobs: list[Job]) -> None:
    """Tell every live job to quit and wait (bounded) for it to exit."""
    live = [job for job in jobs if job.failed is None and signal_workers(job, signal.SIGCONT, "at the end")]
    for job in live:
        job.ctl.write("go", "quit")
    for job in live:
        try:
            rc = next((rc for rc in [p.wait(timeout=QUIT_TIMEOUT_S) for p in job.procs] if rc), 0)
        except subprocess.TimeoutExpired:
            kill_tree(job.procs, job.pids)
            rc = "killed: still running"
        if rc != 0:  # its samples are complete; only its exit went wrong
            print(f"note: {job.key} did not exit cleanly ({rc}): {last_words(job.log)}", file=sys.stderr)


def collect(job: Job, rounds: int) -> dict:
    """What the job's workers wrote: warm records and every rank's samples (a failed job's too)."""
    samples = [[s for rnd in range(rounds) if (s := job.ctl.read(f"sample.{rnd}.{r}")) is not None]
               for r in range(job.workers)]
    return {"kind": job.kind, "failed": job.failed, "warm": job.warm, "samples": samples}


#: Schemes that stay warm through every group of a run that does not fit in memory at once: the
#: per-alternation ratios and the scaling factor are taken against them within each group.
REFERENCES = ("compute", "safusion")
#: Share of the memory available after the references warmed up that a group may take.
MEMORY_SHARE = 0.8


def available_memory() -> int:
    """Bytes the kernel reckons can be allocated without swapping (``MemAvailable``)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def groups_of(others: list[Job], references: list[Job], resident: int | None) -> list[list[Job]]:
    """``others`` in groups that fit in memory beside the warm ``references``: ``resident`` jobs at
    once in all, or where ``None`` as many as :data:`MEMORY_SHARE` of the memory now available
    holds at the references' measured peak per job (the largest of their workers' peaks × workers)."""
    if resident is None:
        peaks = [w["hwm"] * job.workers for job in references for w in job.warm]
        if not peaks:
            return [others] if others else []
        size = max(1, int(MEMORY_SHARE * available_memory() // max(peaks)))
    else:
        size = max(1, resident - len(references))
    return [others[i:i + size] for i in range(0, len(others), size)]


def run_model(link: str, model: str, prefix: list[str], args, not_launched: dict[str, str] | None = None) -> dict:
    """Every scheme's job at one link and model: start and warm up one at a time, then the rounds.
    Where the jobs do not fit in memory at once, the references (:data:`REFERENCES`) stay warm and
    the other schemes run in groups, one after the other, each for every alternation beside the
    references; group ``g``'s alternation ``a`` is round ``g · alternations + a``. Schemes in
    ``not_launched`` (key: why) other than the references are reported failed for that reason
    without a job."""
    from tqdm import tqdm

    name = lambda key: slug(f"{link}-{model}-{key}")  # noqa: E731
    jobs = [Job(key, kind, Control(os.path.join(args.out, "ctl", name(key))),
                os.path.join(args.out, "logs", f"{name(key)}.log"), args.np)
            for key, kind in ((s.label, kind_of(s)) for s in map(parse, args.schemes))]
    references = [job for job in jobs if job.key in REFERENCES]
    for job in jobs:
        if job not in references and job.key in (not_launched or {}):
            job.failed = not_launched[job.key]
            print(f"  {job.key}: {job.failed}", flush=True)
    orders, rounds = [], 0
    try:
        for job in references:
            warm_up(job, commands(job, model, args, prefix), args)
            if job.failed:
                print(f"  {job.key} failed: {job.failed}", flush=True)
        groups = groups_of([job for job in jobs if job not in references and job.failed is None], references,
                           args.resident)
        if len(groups) > 1:
            print(f"  {len(jobs)} jobs do not fit in memory at once: {len(groups)} groups beside "
                  f"{', '.join(j.key for j in references)}: "
                  + "; ".join(" ".join(j.key for j in g) for g in groups), flush=True)
        for g, group in enumerate(groups or [[]]):
            for job in tqdm(group, desc=f"{link} {model} warm-up", file=sys.stdout, dynamic_ncols=True):
                warm_up(job, commands(job, model, args, prefix), args)
                if job.failed:
                    tqdm.write(f"  {job.key} failed: {job.failed}")
            turn = [job for job in jobs if job in references or job in group]  # in the order asked for
            if not turn:  # no job to run: every scheme was not launched
                break
            with tqdm(total=args.alternations * len(turn), desc=f"{link} {model} rounds", file=sys.stdout,
                      dynamic_ncols=True) as bar:
                for alt in range(args.alternations):
                    rnd = g * args.alternations + alt
                    order = turn[rnd % len(turn):] + turn[:rnd % len(turn)]
                    orders.append([job.key for job in order])
                    for job in order:
                        if job.failed is None:
                            take_turn(job, rnd)
                            if job.failed:
                                tqdm.write(f"  {job.key} failed: {job.failed}")
                        bar.update()
            rounds = (g + 1) * args.alternations
            finish(group)  # its memory back before the next group warms up
        finish(references)
    finally:  # an error or Ctrl-C in the driver leaves no job behind, stopped or not
        for job in jobs:
            if any(p.poll() is None for p in job.procs):
                kill_tree(job.procs, job.pids)
    warm = next((w for job in jobs for w in job.warm), {})
    return {"params": warm.get("params"), "model_bytes": warm.get("model_bytes"), "workers": args.np,
            "torch": warm.get("torch"), "orders": orders,
            "jobs": {job.key: collect(job, rounds) for job in jobs}}


def check_schemes(args) -> None:
    """Parse every label before any job (a malformed one stops here), and print what each resolved to."""
    lines = []
    for scheme in map(parse, args.schemes):
        lines.append(describe(scheme, ours_kwargs(scheme, args) if scheme.ours else None))
    print_resolved(lines)


def drive(args) -> None:
    check_schemes(args)  # before any job
    for link in args.links:
        check_link(link)  # before the first job, not after it
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    results: dict = {}
    settings = [(hosts, link) for hosts in (args.hosts or [None]) for link in args.links]
    labels = [link if hosts is None else f"{hosts}x{link}" for hosts, link in settings]
    unknown = [s for s in args.skip if s not in labels]
    if unknown:
        raise SystemExit(f"--skip {' '.join(unknown)}: not a setting of this run; its settings are {' '.join(labels)}")
    settings = [s for s, label in zip(settings, labels) if label not in args.skip]
    if "lstm" in args.models:  # tokenised once here; every worker then reads corpus.py's cache
        sys.path.insert(0, EXAMPLES)
        from corpus import stdlib_corpus
        stdlib_corpus(vocab=args.vocab)
    failed_before: dict[tuple[str, str], dict[str, str]] = {}  # (link, model): scheme -> why
    for hosts, link in settings:
        label = link if hosts is None else f"{hosts}x{link}"  # e.g. 4x1gbit: 4 hosts, 1 Gbit/s each
        args.on_hosts = hosts
        if hosts:
            args.np = hosts  # one worker per host
        print(f"== link {label}: {args.np} workers per job{f' on {hosts} hosts' if hosts else ''}, models "
              f"{' '.join(args.models)}, schemes {' '.join(args.schemes)}", flush=True)
        t0 = time.time()
        # one namespace for all of the link's jobs, or a cluster of hosts with a link each
        with (cluster(hosts, link) if hosts else limited_link(link)) as prefix:
            for model in args.models:
                earlier = failed_before.setdefault((link, model), {})
                res = run_model(label, model, prefix, args, {} if args.relaunch_failed else earlier)
                results.setdefault(label, {})[model] = res
                for key, job in res["jobs"].items():
                    if job["failed"] and key not in earlier:
                        earlier[key] = f"not launched: failed at {label} ({job['failed']})"
        print(f"== link {label}: done in {time.time() - t0:.0f} s", flush=True)
    summary = report(results, args)
    failures = [{"link": link, "model": model, "scheme": key, "reason": job["failed"]}
                for link, by_model in results.items() for model, res in by_model.items()
                for key, job in res["jobs"].items() if job["failed"]]
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "summary": summary, "failures": failures, "raw": results}, f, indent=1)
    plot(summary, os.path.join(args.out, "bench_peers.png"))
    print(f"wrote {args.out}/results.json, bench_peers.png; job logs in {args.out}/logs")


# ---- driver: statistics and report ------------------------------------------------------------
def per_round(samples: list[list[dict]]) -> list[dict]:
    """One scheme's rounds over all ranks (``samples`` per rank): wall = slowest rank, CPU = mean,
    received = the most any rank's host received per step (None outside a cluster)."""
    by_round: dict[int, list[dict]] = {}
    for rank_samples in samples:
        for s in rank_samples:
            by_round.setdefault(s["round"], []).append(s)
    return [{"round": rnd, "wall": max(s["wall"] for s in ss),
             **{k: float(np.mean([s[k] for s in ss])) for k in ("cpu", "training", "other")},
             "received": None if any(s.get("received") is None for s in ss) else max(s["received"] for s in ss)}
            for rnd, ss in sorted(by_round.items()) if len(ss) == len(samples)]


def stats(values) -> dict:
    v = np.asarray(list(values), dtype=float)
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


def ratios(num: list[dict], den: list[dict]) -> dict:
    """Median and min–max of per-round ``num wall / den wall`` (matched by round)."""
    a = {r["round"]: r["wall"] for r in num}
    b = {r["round"]: r["wall"] for r in den}
    return stats(a[k] / b[k] for k in sorted(a.keys() & b.keys()))


def footprint(job: dict) -> dict:
    """One job's memory per worker, the worst rank, in bytes: ``steady`` (resident after build and
    warm-up), ``peak`` (highest resident set over the whole job), ``rise`` (largest rise within a
    round's timed steps) and ``held`` (our optimizer's own tensors; None for the peers)."""
    samples = [s for rank_samples in job["samples"] for s in rank_samples]
    held = [w["held"] for w in job["warm"] if w["held"] is not None]
    return {"steady": max(w["steady"] for w in job["warm"]),
            "peak": max([w["hwm"] for w in job["warm"]] + [s["peak"] for s in samples]),
            "rise": max(s["rise"] for s in samples),
            "held": max(held) if held else None}


def summarise(jobs: dict) -> dict:
    """Per scheme: statistics over rounds, scaling factor, memory; safusion's speedups; failures."""
    failed = {k: job["failed"] for k, job in jobs.items() if job["failed"]}
    rounds = {k: per_round(job["samples"]) for k, job in jobs.items() if k not in failed}
    out: dict = {"schemes": {}, "failed": failed, "speedups": {}}
    for k, rs in rounds.items():
        row = {"wall": stats(r["wall"] for r in rs), "memory": footprint(jobs[k]),
               **{c: stats(r[c] for r in rs) for c in ("cpu", "training", "other")}}
        if rs and all(r["received"] is not None for r in rs):
            row["received"] = stats(r["received"] for r in rs)
        if "compute" in rounds:
            row["scaling"] = ratios(rounds["compute"], rs)
        out["schemes"][k] = row
    if "compute" in out["schemes"]:
        base = out["schemes"]["compute"]["memory"]
        for row in out["schemes"].values():
            row["memory"]["over_compute"] = {c: row["memory"][c] - base[c] for c in ("steady", "peak")}
    if "safusion" in rounds:
        for peer in VS:
            if peer in rounds:
                out["speedups"][peer] = ratios(rounds[peer], rounds["safusion"])
        dense = [p for p in DENSE if p in rounds]
        if dense:
            walls = [{r["round"]: r["wall"] for r in rounds[p]} for p in dense]
            common = sorted(set.intersection(*map(set, walls)))
            if common:  # (schemes run in different groups share no round)
                best = [{"round": rnd, "wall": min(w[rnd] for w in walls)} for rnd in common]
                out["speedups"]["best dense"] = ratios(best, rounds["safusion"])
                out["best_dense_of"] = dense
        if "safusion@0.001" in rounds:
            out["safusion@0.001_vs_safusion"] = ratios(rounds["safusion"], rounds["safusion@0.001"])
    return out


def report(results: dict, args) -> dict:
    """Print a table per model and link; return the summary."""
    fmt = lambda s: f"{s['median']:7.3f} [{s['min']:.3f}–{s['max']:.3f}]"  # noqa: E731
    fx = lambda s: f"{s['median']:5.2f}x [{s['min']:.2f}–{s['max']:.2f}]"  # noqa: E731
    mb = lambda b: f"{b / 1e6:.0f}"  # noqa: E731
    summary: dict = {}
    for model in args.models:
        for link, by_model in results.items():
            res = by_model[model]
            s = summarise(res["jobs"])
            s["params"], s["model_bytes"] = res["params"], res["model_bytes"]
            summary.setdefault(model, {})[link] = s
            cores = next(([w["core"] for w in job["warm"]] for job in res["jobs"].values() if job["warm"]), None)
            weights = f"{s['params'] / 1e6:.1f} M weights" if s["params"] else "no job got warm"
            print(f"\n{model} ({weights}), link {link}, {res['workers']} workers per job, "
                  f"batch {args.batch_size}/worker, {args.alternations} alternations x {args.steps} steps, "
                  f"pinned {cores}")
            w = max([16] + [len(k) for k in res["jobs"]])  # the first column fits the longest label
            print(f"{'scheme':<{w}} {'s/iteration [min–max]':>24} | {'CPU s/it/worker':>15} {'training':>9} "
                  f"{'other thr':>9} | {'scaling [min–max]':>20} | {'steady MB':>9} {'peak MB':>8} "
                  f"{'+steady':>7} {'+peak':>6} {'rise MB':>7} {'held x':>6}")
            for k in res["jobs"]:
                if k in s["failed"]:
                    print(f"{k:<{w}} failed: {s['failed'][k]}")
                    continue
                row, m = s["schemes"][k], s["schemes"][k]["memory"]
                over = m.get("over_compute")
                held = "-" if m["held"] is None else format(m["held"] / s["model_bytes"], ".2f")
                print(f"{k:<{w}} {fmt(row['wall']):>24} | {row['cpu']['median']:>15.3f} "
                      f"{row['training']['median']:>9.3f} {row['other']['median']:>9.3f} | "
                      f"{fx(row['scaling']) if 'scaling' in row else '-':>20} | "
                      f"{mb(m['steady']):>9} {mb(m['peak']):>8} "
                      f"{mb(over['steady']) if over else '-':>7} {mb(over['peak']) if over else '-':>6} "
                      f"{mb(m['rise']):>7} {held:>6}")
            if s["params"]:
                print(f"memory per worker, worst rank, of each scheme's own job: steady = resident after build and "
                      f"warm-up, peak = highest over the job; +steady/+peak = over compute's job; rise = largest "
                      f"within a round's timed steps; held x = our optimizer's own tensors / the model's "
                      f"{s['model_bytes'] / 1e6:.0f} MB of weights")
            scaling = {k: row["scaling"] for k, row in s["schemes"].items() if "scaling" in row and k != "compute"}
            if scaling:
                print("scaling factor = compute s/it / scheme s/it (median [min–max] of per-alternation ratios; "
                      "1: communication costs nothing)")
                for k, r in scaling.items():
                    print(f"  {k:<{w}} {fx(r)}")
            if s["speedups"]:
                print("safusion speedup = peer s/it / safusion s/it (median [min–max] of per-alternation "
                      "ratios; >1: safusion faster)")
                for peer, r in s["speedups"].items():
                    extra = ""
                    if peer == "best dense":
                        extra = f"  (fastest of {'/'.join(s['best_dense_of'])} each alternation)"
                    print(f"  vs {peer:<14} {fx(r)}{extra}")
            plans = {k: job["samples"][0][-1]["saf"] for k, job in res["jobs"].items()
                     if k in s["schemes"] and "saf" in job["samples"][0][-1]}
            s["plans"] = plans
            for k, info in plans.items():
                how = "dense allreduce" if info.get("dense") else f"sparse over {info.get('communicator') or '?'}"
                options = info.get("predicted_options_s") or {}
                print(f"{k}: {how}, {info.get('buffers')} buffers, {info.get('bytes_sent', 0) / 1e6:.2f} MB sent per "
                      f"step by rank 0" + (f"; predicted s/it {', '.join(f'{o} {t:.3f}' for o, t in options.items())}"
                                           if options else ""))
            if "safusion@0.001_vs_safusion" in s:
                print(f"safusion@0.001 vs safusion = safusion s/it / safusion@0.001 s/it: "
                      f"{fx(s['safusion@0.001_vs_safusion'])}")
    return summary


def plot(summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [(m, link, s) for m, by_link in summary.items() for link, s in by_link.items()]
    links = list(dict.fromkeys(p[1] for p in panels))
    models = list(summary)
    fig, axes = plt.subplots(len(models), len(links), figsize=(5.2 * len(links), 4.2 * len(models)),
                             squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for model, link, s in panels:
        ax = axes[models.index(model)][links.index(link)]
        ax.set_visible(True)
        keys = list(s["schemes"])
        med = np.array([s["schemes"][k]["wall"]["median"] for k in keys])
        lo = med - np.array([s["schemes"][k]["wall"]["min"] for k in keys])
        hi = np.array([s["schemes"][k]["wall"]["max"] for k in keys]) - med
        colors = ["0.6" if k == "compute" else "C3" if parse(k).ours else "C0" for k in keys]
        ax.bar(range(len(keys)), med, yerr=[lo, hi], capsize=3, color=colors)
        for i, m in enumerate(med):
            ax.annotate(f"{m:.2f}", (i, m), xytext=(3, 2), textcoords="offset points", fontsize=6)
        for i, k in enumerate(s["failed"], start=len(keys)):
            ax.annotate("failed", (i, 0), xytext=(0, 2), textcoords="offset points", fontsize=6, ha="center",
                        color="C3")
        handles = [Patch(color="C0", label="peers"), Patch(color="C3", label="horovod_safusion")]
        if "compute" in s["schemes"]:
            handles.append(ax.axhline(s["schemes"]["compute"]["wall"]["median"], color="k", ls="--", lw=1,
                                      label="compute alone"))
        ax.legend(handles=handles, fontsize=7, loc="upper left")
        ticks = keys + list(s["failed"])
        ax.set_xticks(range(len(ticks)), ticks, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel("s/iteration (median, bars: min–max)")
        ax.set_title(f"{model}, link {link}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


WORKER_ARGS = ("steps", "profile_steps", "batch_size", "bptt", "vocab", "seed", "width", "hidden")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2, help="workers per job")
    ap.add_argument("--hosts", type=int, nargs="+", default=None,
                    help="run on a cluster on one machine (scripts/cluster.sh; root) of each of these numbers of "
                         "hosts, one worker per host, each host with a link of each --links rate; replaces --np")
    ap.add_argument("--links", nargs="+", default=[LOOPBACK, "1gbit", "200mbit"],
                    help="'loopback' or tc rates (each in a network namespace; needs root)")
    ap.add_argument("--skip", nargs="+", default=[], metavar="LABEL",
                    help="settings of hosts and link not to run, as labelled in the results (e.g. 8x200mbit)")
    ap.add_argument("--relaunch-failed", action="store_true",
                    help="with several --hosts: launch again, at the next number of hosts, a scheme that failed "
                         "at a smaller one on the same model and link (by default it is reported failed, with "
                         "the first failure's reason, without a job)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES),
                    help="subset of the defaults, plus name:key=value:... variants of our optimizer")
    ap.add_argument("--alternations", type=int, default=5, help="rounds over all schemes")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per scheme per round")
    ap.add_argument("--resident", type=int, default=None,
                    help="jobs warm at once (default: as many as fit in memory, measured; more schemes run in "
                         "groups beside compute and safusion)")
    ap.add_argument("--profile-steps", type=int, default=10, help="our optimizer's profiling steps")
    ap.add_argument("--batch-size", type=int, default=16, help="per worker (images, or sequences for lstm)")
    ap.add_argument("--bptt", type=int, default=35, help="lstm: tokens per sequence")
    ap.add_argument("--vocab", type=int, default=10000, help="lstm: vocabulary size")
    ap.add_argument("--width", type=int, default=64, help="resnet18: base width (64: 11.2 M weights)")
    ap.add_argument("--hidden", type=int, default=650, help="lstm: embedding and hidden units (650: 19.8 M weights)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="pin worker r to core r %% cores")
    ap.add_argument("--timeout", type=float, default=1800,
                    help="seconds a job may take to start and warm up before it is killed as failed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_peers")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1 or args.alternations < 1:
        ap.error("--steps and --alternations must be at least 1")
    if args.hosts and min(args.hosts) < 1:
        ap.error(f"--hosts must be at least 1, got {args.hosts}")
    if args.worker:
        sys.path.insert(0, EXAMPLES)
        worker(args)
    else:
        args.out = os.path.abspath(args.out)  # the workers run elsewhere and must find its files
        drive(args)


if __name__ == "__main__":
    main()
