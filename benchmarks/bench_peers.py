"""SAFusion against what a user would pick instead, side by side in one job per link.

    python benchmarks/bench_peers.py [--links loopback 1gbit 200mbit] [--models resnet18 lstm]
                                     [--schemes ...] [--alternations 5 --steps 3]

Peers (each a key in the results):

    compute        every worker runs forward/backward/SGD step, no communication (the limit)
    horovod        hvd.DistributedOptimizer (dense allreduce, Horovod's Tensor Fusion)
    horovod-fp16   the same with compression=hvd.Compression.fp16
    ddp            torch DistributedDataParallel, gloo backend
    ddp-powersgd   DDP with PowerSGD's comm hook, rank 4, started after the warm-up, in ONE DDP
                   bucket: the hook starts its 2nd and 3rd allreduce from completion callbacks,
                   and with several buckets Gloo ranks can start them in different orders (a
                   race; here it aborted a job with "op.preamble.length <= op.nbytes")
    safusion       horovod_safusion.DistributedOptimizer(opt, named_parameters=...) with no other
                   arguments (the user's default; only ``profile_steps`` is passed, and only when
                   ``--profile-steps`` differs from the library default)
    wfbp           the same with fusion="wfbp" (one buffer per tensor)
    density-0.001  the default at density=0.001

``--schemes`` picks a subset and adds variants written ``name:key=value:key=value``; the pairs are
keyword arguments of ``horovod_safusion.DistributedOptimizer`` (``density`` is a float,
``profile_steps``/``replan_every`` ints, ``true``/``false`` booleans, the rest strings), laid
over ``name``'s own arguments when ``name`` is one of our schemes above, or with ``fusion=name``
when it names a fusion planner. The whole string is the variant's key, e.g.
``safusion:compressor=topk:density=0.01``.

Models: ``resnet18`` (CIFAR ResNet-18, width 64: 11.2 M weights in 62 tensors; batch 16/worker of
fixed random 3×32×32 images, SGD lr 0.01 momentum 0.9) and ``lstm`` (word-level 2-layer LSTM
language model, 650 units, vocabulary 10000: 19.8 M weights, mostly the embedding and decoder;
16 sequences × 35 tokens/worker of the Python standard library's source, see
``examples/corpus.py``; SGD lr 0.1 momentum 0.9; no clipping).

Method. The driver runs ONE ``horovodrun -np N --gloo`` job per link — ``loopback`` as is, a tc rate
such as ``1gbit`` inside a fresh network namespace whose loopback is limited (``links.py``; needs
root). In the job each worker also joins a ``torch.distributed`` gloo group on the same ranks, so
DDP and Horovod run in the same processes. Per model, every scheme's model (same seed; Horovod
schemes broadcast from rank 0, DDP broadcasts itself) and optimizer is built once and warmed up once
(our optimizers for ``profile_steps + 3`` steps: profile, plan, then steady state; PowerSGD past its
start iteration plus 2; the rest 3). Then ``--alternations`` rounds: in each, every scheme in turn
runs 1 untimed step, a barrier, and ``--steps`` timed steps. The order is fixed but the starting
scheme rotates each round, so drift and order effects spread over all schemes. Per scheme and round:
seconds/iteration (the slowest rank), CPU seconds/iteration per worker (``time.process_time``, mean
of ranks) and its split by thread from ``/proc/self/task/*/stat``: the main thread (``training``:
forward, backward, sparsification, the step) and all ``other threads`` (Horovod's background thread,
Gloo's loops). CPU time counts waiting that spins: Horovod's wait for its allreduces keeps the main
thread busy (at 200mbit its training thread used 3.7 CPU s of a 3.8 s iteration), so for slow dense
peers it measures the wait too. The report gives medians with min–max over rounds, the scaling
factor (median of compute-time / scheme-time per round) and safusion's speedups (median of per-round
``peer s/it / safusion s/it``; >1: we are faster) against each peer and against the best dense one
of that round. Wall time on these shared 2-core machines moves by up to 2x between runs, so only
per-round ratios and CPU seconds are worth comparing; CPU seconds drift far less. Raw per-rank,
per-round samples and the summary go to ``--out``/results.json, the bars to
``--out``/bench_peers.png.

``--pin`` (default on) pins worker r to core ``r % cores`` (all its threads, so Horovod's and
Gloo's threads share their worker's core). It made runs steadier here: loopback, ResNet-18, 2
workers on 2 cores shared with another user's jobs, 4 alternations x 2 steps, two pairs of runs
in both orders — compute alone 0.756 s/it [0.702–0.792] and 0.765 [0.649–0.879] pinned against
1.278 [1.100–2.826] and 1.064 [0.776–1.398] unpinned; horovod 0.836 [0.813–0.966] and 0.833
[0.728–1.074] pinned, 1.679 [1.434–2.509] and 2.125 [1.413–2.807] unpinned. Pinned, wall time
comes close to CPU time (0.66–0.71 CPU s/it for compute): the two workers stop taking turns on
the same core. ``--no-pin`` when the workers outnumber the cores or other jobs are pinned.

Memory per worker and scheme: after a throwaway model has trained two steps (what the process
allocates once is nobody's), the schemes are built and warmed up one after the other, so the
resident set (``VmRSS`` with the allocator's free memory handed back) after a scheme's build and
warm-up minus before is what the scheme holds (its model, its optimizer, gradients, its state:
``steady``); the peak (``VmHWM``, restarted per phase with ``/proc/self/clear_refs``) during its
build and warm-up (profiling and the plan switch included) and during its timed steps gives its
``peak`` over the same baseline. ``held`` is what our optimizer holds in its own tensors
(:func:`horovod_safusion.memory.held`). Every scheme's model and optimizer live at once, so the
job's own peak is their sum: with more workers than 2 on a small machine run ``--models`` one at a
time or fewer schemes.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from links import LOOPBACK, check_link, limited_link  # noqa: E402

PEERS = ("compute", "horovod", "horovod-fp16", "ddp", "ddp-powersgd")
OURS = {"safusion": {}, "wfbp": {"fusion": "wfbp"}, "density-0.001": {"density": 0.001}}
DEFAULT_SCHEMES = (*PEERS, *OURS)
DENSE = ("horovod", "horovod-fp16", "ddp")
VS = ("horovod", "horovod-fp16", "ddp", "ddp-powersgd")
MODELS = ("resnet18", "lstm")
DENSE_WARMUP = 3  # steps for the peers' first iterations (allocation, DDP's bucket rebuild)
INT_KEYS = ("profile_steps", "replan_every")


# ---- schemes ----------------------------------------------------------------------------------
def parse_scheme(token: str) -> tuple[str, str, dict]:
    """``token`` -> (key, kind, kwargs); kind is a peer's name or ``"saf"`` for our optimizer."""
    name, *pairs = token.split(":")
    if not pairs:
        if name in PEERS:
            return token, name, {}
        if name in OURS:
            return token, "saf", dict(OURS[name])
        raise SystemExit(f"--schemes {token}: unknown scheme; known: {', '.join(DEFAULT_SCHEMES)}, "
                         "or name:key=value:... for horovod_safusion.DistributedOptimizer arguments")
    if name in PEERS:
        raise SystemExit(f"--schemes {token}: key=value options are for our optimizer, not for {name}")
    kwargs = dict(OURS.get(name, {"fusion": name}))
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--schemes {token}: {pair!r} is not key=value")
        try:
            if key == "density":
                kwargs[key] = float(value)
            elif key in INT_KEYS:
                kwargs[key] = int(value)
            else:  # true/false become booleans (e.g. dense=false), anything else stays a string
                kwargs[key] = {"true": True, "false": False}.get(value.lower(), value)
        except ValueError:
            raise SystemExit(f"--schemes {token}: {key}={value!r} is not a number") from None
    return token, "saf", kwargs


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


class Run:
    """One scheme of one model: its model, optimizer, data and step counter."""

    def __init__(self, key, model, opt, data, loss_fn, warmup):
        self.key, self.model, self.opt, self.data, self.loss_fn = key, model, opt, data, loss_fn
        self.warmup, self.step_no = warmup, 0

    def step(self) -> None:
        x, y = self.data(self.step_no)
        self.step_no += 1
        self.opt.zero_grad()
        self.loss_fn(self.model(x), y).backward()
        self.opt.step()


def make_task(name: str, rank: int, size: int, args):
    """(model factory, data(step) -> (x, y), loss, lr, parameter count) for model ``name``."""
    import torch
    import torch.nn.functional as F
    from models import LSTMLanguageModel, resnet18

    g = torch.Generator().manual_seed(args.seed + 1000 + rank)
    if name == "resnet18":
        x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (args.batch_size,), generator=g)
        return (lambda: resnet18(num_classes=10, in_channels=3, width=64)), (lambda step: (x, y)), F.cross_entropy, 0.01
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

        return (lambda: LSTMLanguageModel(len(itos))), data, loss, 0.1
    raise SystemExit(f"--models {name}: unknown model; known: {', '.join(MODELS)}")


def build(key: str, kind: str, kwargs: dict, make_model, data, loss_fn, lr: float, args) -> Run:
    """The model and optimizer of one scheme, ready for its warm-up."""
    import inspect
    import torch
    import horovod.torch as hvd
    import horovod_safusion as saf

    torch.manual_seed(args.seed)
    model = make_model()
    sgd = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    warmup = DENSE_WARMUP
    if kind == "compute":
        opt = sgd(model.parameters())
    elif kind in ("horovod", "horovod-fp16"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = hvd.Compression.fp16 if kind == "horovod-fp16" else hvd.Compression.none
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                       compression=compression)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
        opt = sgd(model.parameters())
    elif kind == "ddp-powersgd":
        # One bucket: PowerSGD's hook starts its 2nd and 3rd allreduce in completion callbacks (on
        # Gloo's thread); with several buckets the ranks can start them in different orders
        # against the next bucket's first allreduce (a race; seen here as Gloo's
        # "op.preamble.length <= op.nbytes" abort). A bucket as large as the model avoids it.
        mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=int(mb) + 1)
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
        model.register_comm_hook(P.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                 start_powerSGD_iter=DENSE_WARMUP), P.powerSGD_hook)
        warmup = DENSE_WARMUP + 2  # past the start iteration, compressing for 2 steps
        opt = sgd(model.parameters())
    elif kind == "saf":
        kwargs = dict(kwargs)
        default = inspect.signature(saf.DistributedOptimizer).parameters["profile_steps"].default
        if "profile_steps" not in kwargs and args.profile_steps != default:
            kwargs["profile_steps"] = args.profile_steps
        if kwargs.get("fusion") not in (None, *saf.available_planners()):
            raise SystemExit(f"--schemes {key}: fusion {kwargs['fusion']!r} is not a planner; known: "
                             f"{', '.join(saf.available_planners())}")
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = saf.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(), **kwargs)
        warmup = kwargs.get("profile_steps", default) + 3  # 1 warm-up + profile, re-plan, 2 more
    else:
        raise AssertionError(kind)
    return Run(key, model, opt, data, loss_fn, warmup)


def saf_info(opt) -> dict:
    """What our optimizer planned and sent last (best effort: only what the optimizer exposes)."""
    info = {}
    plan = getattr(opt, "plan", None)
    if plan is not None and hasattr(plan, "buffers"):
        info["buffers"] = len(plan.buffers)
        info["planner"] = getattr(plan, "planner", None)
        info["dense"] = bool(getattr(plan, "dense", False))
    st = getattr(opt, "last_stats", None)
    if st is not None:
        for k in ("bytes_sent", "bytes_received", "selected", "elements", "missing", "tensors"):
            if hasattr(st, k):
                info[k] = int(getattr(st, k))
    return info


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


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import horovod.torch as hvd
    from tqdm import tqdm
    from horovod_safusion import memory

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=size)
    core = pin_threads(rank) if args.pin else None
    schemes = [parse_scheme(t) for t in args.schemes]
    barrier = lambda: hvd.allreduce(torch.zeros(1), name="bench_peers.barrier")  # noqa: E731
    raw: dict[str, dict] = {}
    meta: dict[str, dict] = {}
    for model_name in args.models:
        make_model, data, loss_fn, lr = make_task(model_name, rank, size, args)
        probe = make_model()
        params = sum(p.numel() for p in probe.parameters())
        model_bytes = sum(p.numel() * p.element_size() for p in probe.parameters())
        del probe
        runs, mem = [], {}
        throwaway = build("compute", "compute", {}, make_model, data, loss_fn, lr, args)
        for _ in range(2):  # what the process allocates once (thread pools, caches) is not any scheme's
            throwaway.step()
        del throwaway
        with tqdm(total=len(schemes), desc=f"{args.link} {model_name} warm-up", disable=rank != 0,
                  file=sys.stdout, dynamic_ncols=True) as bar:
            for key, kind, kw in schemes:  # each built and warmed up in turn: its memory apart
                barrier()
                before = memory.resident()
                memory.reset_peak()
                run = build(key, kind, kw, make_model, data, loss_fn, lr, args)
                for _ in range(run.warmup):
                    run.step()
                while not getattr(run.opt, "settled", True):  # our profile, and a sparse/dense trial
                    run.step()
                peak = memory.rss()["hwm"] - before
                mem[key] = {"steady": memory.resident() - before, "warmup_peak": peak, "step_peak": 0,
                            "held": memory.held(run.opt).bytes if kind == "saf" else None}
                runs.append(run)
                bar.update()
        samples: dict[str, list] = {run.key: [] for run in runs}
        orders = []
        with tqdm(total=args.alternations * len(runs), desc=f"{args.link} {model_name} rounds",
                  disable=rank != 0, file=sys.stdout, dynamic_ncols=True) as bar:
            for rnd in range(args.alternations):
                order = runs[rnd % len(runs):] + runs[:rnd % len(runs)]
                orders.append([r.key for r in order])
                for run in order:
                    run.step()  # untimed: the switch from the previous scheme
                    barrier()
                    base = memory.rss()["rss"]
                    memory.reset_peak()
                    th0, c0, t0 = thread_cpu(), time.process_time(), time.perf_counter()
                    for _ in range(args.steps):
                        run.step()
                    wall = (time.perf_counter() - t0) / args.steps
                    cpu = (time.process_time() - c0) / args.steps
                    main, other, by = thread_delta(th0, thread_cpu())
                    m = mem[run.key]
                    m["step_peak"] = max(m["step_peak"], memory.rss()["hwm"] - base)
                    sample = {"round": rnd, "wall": wall, "cpu": cpu, "training": main / args.steps,
                              "other": other / args.steps, "threads": {k: v / args.steps for k, v in by.items()}}
                    if run.key in OURS or ":" in run.key:
                        sample["saf"] = saf_info(run.opt)
                    samples[run.key].append(sample)
                    bar.update()
        raw[model_name] = hvd.allgather_object(samples, name=f"bench_peers.samples.{model_name}")
        meta[model_name] = {"params": params, "orders": orders,
                            "warmup": {run.key: run.warmup for run in runs},
                            "model_bytes": model_bytes,
                            "memory": hvd.allgather_object(mem, name=f"bench_peers.memory.{model_name}"),
                            "max_rss_gb": hvd.allgather_object(
                                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                                name=f"bench_peers.rss.{model_name}")}
        del runs
        gc.collect()
    cores = hvd.allgather_object(core, name="bench_peers.cores")
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"workers": size, "pinned_cores": cores, "torch": torch.__version__, "meta": meta,
                       "per_rank": raw}, f)
    dist.destroy_process_group()


# ---- driver -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(cmd: list[str], timeout: float, env: dict) -> int:
    """Run ``cmd`` with output to the terminal; past ``timeout`` s kill it and everything it started."""
    import psutil

    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        try:
            kids = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        os.killpg(proc.pid, signal.SIGKILL)
        for k in kids:  # Horovod's launcher puts workers in sessions of their own
            try:
                k.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
        if isinstance(e, KeyboardInterrupt):
            raise
        print(f"*** killed after {timeout} s (hang) ***", file=sys.stderr, flush=True)
        return -signal.SIGKILL


def check_schemes(tokens: list[str]) -> None:
    """Stop before any job on a malformed scheme or an unknown planner or compressor name."""
    parsed = [parse_scheme(t) for t in tokens]
    if not any(":" in key for key, _, _ in parsed):
        return
    import horovod_safusion as saf
    for key, _, kw in parsed:
        for option, known in (("fusion", saf.available_planners()), ("compressor", saf.available_compressors())):
            if isinstance(kw.get(option), str) and kw[option] not in known:
                raise SystemExit(f"--schemes {key}: {option} {kw[option]!r} is unknown; known: {', '.join(known)}")


def drive(args) -> None:
    check_schemes(args.schemes)  # before any job
    for link in args.links:
        check_link(link)  # before the first job, not after it
    os.makedirs(args.out, exist_ok=True)
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or "horovodrun"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    results, failed = {}, None
    for link in args.links:
        result = os.path.join(args.out, f"raw-{link}.json")
        if os.path.exists(result):
            os.remove(result)
        cmd = [horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo",
               sys.executable, os.path.abspath(__file__), "--worker", "--result", result,
               "--port", str(free_port()), "--link", link, "--pin" if args.pin else "--no-pin",
               *sum(([f"--{k.replace('_', '-')}", *map(str, v if isinstance(v, list) else [v])]
                     for k, v in vars(args).items() if k in WORKER_ARGS), [])]
        print(f"== link {link}: {args.np} workers, models {' '.join(args.models)}, "
              f"schemes {' '.join(args.schemes)}", flush=True)
        t0 = time.time()
        with limited_link(link) as prefix:
            rc = run_job(prefix + cmd, args.timeout, env)
        if rc != 0 or not os.path.exists(result):
            failed = f"link {link}: the job failed (exit status {rc})"
            break
        print(f"== link {link}: done in {time.time() - t0:.0f} s", flush=True)
        with open(result) as f:
            results[link] = json.load(f)
    if results:
        summary = report(results, args)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"args": vars(args), "summary": summary, "raw": results}, f, indent=1)
        plot(summary, os.path.join(args.out, "bench_peers.png"))
        print(f"wrote {args.out}/results.json, bench_peers.png")
    if failed:
        raise SystemExit(failed)


def per_round(per_rank: list[dict], key: str) -> list[dict]:
    """One scheme's rounds over all ranks: wall = slowest rank, CPU = mean of ranks."""
    rounds = []
    for samples in zip(*(r[key] for r in per_rank)):
        rounds.append({"round": samples[0]["round"],
                       "wall": max(s["wall"] for s in samples),
                       **{k: float(np.mean([s[k] for s in samples])) for k in ("cpu", "training", "other")}})
    return rounds


def stats(values) -> dict:
    v = np.asarray(list(values), dtype=float)
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


def ratios(num: list[dict], den: list[dict]) -> dict:
    """Median and min–max of per-round ``num wall / den wall`` (matched by round)."""
    a = {r["round"]: r["wall"] for r in num}
    b = {r["round"]: r["wall"] for r in den}
    return stats(a[k] / b[k] for k in sorted(a.keys() & b.keys()))


def footprint(per_rank_memory: list[dict], key: str) -> dict:
    """One scheme's memory per worker, the worst rank, in bytes: ``steady`` (resident after its
    build and warm-up, minus before), ``peak`` (the larger of the peak during build and warm-up and
    steady plus the largest rise within its timed steps) and ``held`` (our optimizer's own tensors,
    :func:`horovod_safusion.memory.held`; None for the peers)."""
    ms = [m[key] for m in per_rank_memory]
    held = [m["held"] for m in ms if m["held"] is not None]
    return {"steady": max(m["steady"] for m in ms),
            "peak": max(max(m["warmup_peak"], m["steady"] + m["step_peak"]) for m in ms),
            "held": max(held) if held else None}


def summarise(per_rank: list[dict], per_rank_memory: list[dict] | None = None) -> dict:
    keys = list(per_rank[0])
    rounds = {k: per_round(per_rank, k) for k in keys}
    out = {"schemes": {}, "speedups": {}}
    for k in keys:
        row = {"wall": stats(r["wall"] for r in rounds[k]),
               **{c: stats(r[c] for r in rounds[k]) for c in ("cpu", "training", "other")}}
        if "compute" in rounds:
            row["scaling"] = ratios(rounds["compute"], rounds[k])
        if per_rank_memory:
            row["memory"] = footprint(per_rank_memory, k)
        out["schemes"][k] = row
    if "safusion" in rounds:
        for peer in VS:
            if peer in rounds:
                out["speedups"][peer] = ratios(rounds[peer], rounds["safusion"])
        dense = [p for p in DENSE if p in rounds]
        if dense:
            best = [{"round": rs[0]["round"], "wall": min(r["wall"] for r in rs)}
                    for rs in zip(*(rounds[p] for p in dense))]
            out["speedups"]["best dense"] = ratios(best, rounds["safusion"])
            out["best_dense_of"] = dense
        if "density-0.001" in rounds:
            out["density-0.001_vs_safusion"] = ratios(rounds["safusion"], rounds["density-0.001"])
    return out


def report(results: dict, args) -> dict:
    fmt = lambda s: f"{s['median']:7.3f} [{s['min']:.3f}–{s['max']:.3f}]"  # noqa: E731
    fx = lambda s: f"{s['median']:5.2f}x [{s['min']:.2f}–{s['max']:.2f}]"  # noqa: E731
    summary: dict = {}
    for model in args.models:
        for link, res in results.items():
            if model not in res["per_rank"]:
                continue
            meta = res["meta"][model]
            s = summarise(res["per_rank"][model], meta.get("memory"))
            s["params"] = meta["params"]
            mb = s["model_bytes"] = meta.get("model_bytes", 4 * meta["params"])
            s["max_rss_gb"] = res["meta"][model]["max_rss_gb"]
            summary.setdefault(model, {})[link] = s
            print(f"\n{model} ({s['params'] / 1e6:.1f} M weights), link {link}, {res['workers']} workers, "
                  f"batch {args.batch_size}/worker, {args.alternations} alternations x {args.steps} steps, "
                  f"pinned {res['pinned_cores']}")
            print(f"{'scheme':<16} {'s/iteration [min–max]':>24} | {'CPU s/it/worker':>15} {'training':>9} "
                  f"{'other thr':>9} | {'scaling [min–max]':>20} | {'steady MB':>9} {'peak MB':>8} {'held x':>6}")
            for k, row in s["schemes"].items():
                m = row.get("memory")
                mem = (f"{m['steady'] / 1e6:9.0f} {m['peak'] / 1e6:8.0f} "
                       f"{'-' if m['held'] is None else format(m['held'] / mb, '.2f'):>6}") if m else ""
                print(f"{k:<16} {fmt(row['wall']):>24} | {row['cpu']['median']:>15.3f} "
                      f"{row['training']['median']:>9.3f} {row['other']['median']:>9.3f} | "
                      f"{fx(row['scaling']) if 'scaling' in row else '-':>20} | {mem}")
            print(f"memory per worker, worst rank: steady = resident after the scheme's build and warm-up "
                  f"minus before (its model copy and state, {mb / 1e6:.0f} MB of weights); peak = its "
                  "highest rise over that baseline; held x = our optimizer's own tensors / the model")
            if s["speedups"]:
                print("safusion speedup = peer s/it / safusion s/it (median [min–max] of per-alternation "
                      "ratios; >1: safusion faster)")
                for peer, r in s["speedups"].items():
                    extra = ""
                    if peer == "best dense":
                        extra = f"  (fastest of {'/'.join(s['best_dense_of'])} each alternation)"
                    print(f"  vs {peer:<14} {fx(r)}{extra}")
            plans = {k: v[-1]["saf"] for k, v in res["per_rank"][model][0].items() if v and "saf" in v[-1]}
            s["plans"] = plans
            for k, info in plans.items():
                print(f"{k}: {'dense allreduce' if info.get('dense') else 'sparse'}, {info.get('buffers')} buffers, "
                      f"{info.get('bytes_sent', 0) / 1e6:.2f} MB sent per step by rank 0")
            if "density-0.001_vs_safusion" in s:
                print(f"density-0.001 vs safusion = safusion s/it / density-0.001 s/it: "
                      f"{fx(s['density-0.001_vs_safusion'])}")
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
        colors = ["0.6" if k == "compute" else "C3" if k in OURS or ":" in k else "C0" for k in keys]
        ax.bar(range(len(keys)), med, yerr=[lo, hi], capsize=3, color=colors)
        for i, m in enumerate(med):
            ax.annotate(f"{m:.2f}", (i, m), xytext=(3, 2), textcoords="offset points", fontsize=6)
        handles = [Patch(color="C0", label="peers"), Patch(color="C3", label="horovod_safusion")]
        if "compute" in s["schemes"]:
            handles.append(ax.axhline(s["schemes"]["compute"]["wall"]["median"], color="k", ls="--", lw=1,
                                      label="compute alone"))
        ax.legend(handles=handles, fontsize=7, loc="upper left")
        ax.set_xticks(range(len(keys)), keys, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel("s/iteration (median, bars: min–max)")
        ax.set_title(f"{model}, link {link}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


WORKER_ARGS = ("models", "schemes", "alternations", "steps", "profile_steps", "batch_size", "bptt", "vocab", "seed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2, help="workers")
    ap.add_argument("--links", nargs="+", default=[LOOPBACK, "1gbit", "200mbit"],
                    help="'loopback' or tc rates (each in a network namespace; needs root)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES),
                    help="subset of the defaults, plus name:key=value:... variants of our optimizer")
    ap.add_argument("--alternations", type=int, default=5, help="rounds over all schemes")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per scheme per round")
    ap.add_argument("--profile-steps", type=int, default=10, help="our optimizer's profiling steps")
    ap.add_argument("--batch-size", type=int, default=16, help="per worker (images, or sequences for lstm)")
    ap.add_argument("--bptt", type=int, default=35, help="lstm: tokens per sequence")
    ap.add_argument("--vocab", type=int, default=10000, help="lstm: vocabulary size")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="pin worker r to core r %% cores")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per link's job before it is killed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_peers")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--link", default=LOOPBACK, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1 or args.alternations < 1:
        ap.error("--steps and --alternations must be at least 1")
    if args.worker:
        sys.path.insert(0, os.path.join(HERE, "..", "examples"))
        worker(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
