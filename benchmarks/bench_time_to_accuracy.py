"""Time to accuracy on emulated links: how much sooner a job reaches its quality with the plugin.

    python benchmarks/bench_time_to_accuracy.py [--models digits lstm] [--hosts 2 4 8]
        [--links 100mbit 1gbit] [--seeds 0] [--schemes ...] [--out out/bench_tta]   (as root)
    make bench-tta                                                                (the same)

Users buy time to a given accuracy, not seconds per iteration. Per model, link and seed every
scheme trains the same model from the same initialisation on the same data order, as its own job
with its own launcher, one worker on each host of a cluster on one machine (``scripts/cluster.sh``,
every host's link limited by ``tc``; ``benchmarks/links.py``), at every count of ``--hosts`` and
every rate of ``--links`` (a *cell*); ``--hosts 0`` runs ``--np`` workers on one host behind one
limited link instead:

* ``horovod``: ``hvd.DistributedOptimizer``, dense; ``horovod-fp16``: the same with
  ``Compression.fp16`` (horovodrun);
* ``ddp-powersgd``: PyTorch DDP with its PowerSGD hook, rank 4, its default bucketing, dense for
  the first 10 % of the steps (``start_powerSGD_iter``) (torchrun). With several buckets on Gloo
  the hook's callbacks can start their allreduces in different orders on different ranks, and the
  job aborts (``op.preamble.length <= op.nbytes``) or hangs; where it does, the seed is run again
  in one bucket (``bucket_cap_mb`` above the model's size), and the table says so
  (``ddp-powersgd (1 bucket)``). A default-bucket job is taken for hung after 1.5 times the
  longest job of its cell so far; once the default buckets failed on a model, its later cells
  run one bucket at once, saying so. ``ddp-powersgd-1bucket`` asks for one bucket from the start;
* ours, ``horovod_safusion.DistributedOptimizer`` with its defaults (``safusion``) and with
  ``density="auto"`` (``safusion@auto``) (horovodrun); on request (``--schemes``) any other label
  of :mod:`schemes`' grammar, the same in every benchmark, e.g. ``safusion@0.001+dgc``
  (``density=0.001`` with DGC's techniques: momentum correction with masking, a warm-up over the
  first 10 % of the steps, local clipping where the task clips), ``safusion@0.01+warmup`` (DGC's
  exponential warm-up alone), ``safusion@0.03`` or ``safusion@0.1+densestart``. The driver prints
  what each label resolved to before the first job.

**What fits an hour.** The default run — both models, 2, 4 and 8 hosts, 100 Mbit/s and 1 Gbit/s,
five schemes — is 60 jobs a seed (and a failed PowerSGD job), so it runs one seed (``--seeds 0``): a
cell's ratios are then one run's, with no spread across seeds, and a target that a scheme reaches
only at its last evaluation is reached or missed by one run's noise. ``--seeds 0 1 2`` gives medians
and ranges at three times the time.

The models and their data are ``bench_convergence``'s: the digits CNN (metric: test accuracy; here
at width 64, 145 k weights, the demo's, which a 100 Mbit/s link holds back; ``--digits-width 32`` is
``bench_convergence``'s 61 k) and the LSTM language model (metric: validation perplexity).
**Targets, fixed before the runs:** the median final metric of dense Horovod over the seeds of the
same model and link, less 1 accuracy point (digits) or plus 3 % perplexity (LSTM). A scheme's time
to the target is the training seconds (evaluations excluded and reported apart, so that they are
charged to no scheme) until its metric first reaches the target; a seed that never does counts as
missing (``—``). Each worker evaluates its own shard of the held-out set and the ranks' sums are
added (``bench_convergence.Task``), so an evaluation costs the job one evaluation's work, not one
per worker. Every job is launched with the driver's environment less the cycle time that
importing the plugin set in it (``links.job_environ``), so Horovod's and PowerSGD's jobs run with
their own defaults.

Within a cell jobs run seed by seed, the schemes' order rotating from seed to seed, so that a drift
of the machine's speed spreads over all schemes; ratios are taken per seed (the same seed's jobs ran
next to each other) and their median and min–max are reported (``Horovod/it``: Horovod's time to the
target over this scheme's; ``PowerSGD/it`` and ``PSGD-1b/it`` likewise). Curves of quality against
*wall time* (training seconds; medians over seeds with their min–max band), one panel per cell, go
to ``--out``/tta_{model}.png, the table and every run (its curve, and each step's seconds and CPU
seconds) to ``--out``/results.json. Needs root, iproute2 and openssh-server (the cluster); ``--hosts 0
--links loopback`` runs without.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from links import check_link, cluster, job_environ, launchers, limited_link, run_job as run_launchers  # noqa: E402
from schemes import PerTask, describe, parse, print_resolved  # noqa: E402

SCHEMES = ("horovod", "horovod-fp16", "ddp-powersgd", "safusion", "safusion@auto")  # the default run
ONE_BUCKET = "ddp-powersgd-1bucket"  # where ddp-powersgd's default buckets fail
HANG_FACTOR = 1.5  # a default-bucket PowerSGD job running this many times the cell's longest job so far hangs
QUALITY = {"digits": 0.01, "lstm": 0.03}  # the targets: dense − 1 point, dense + 3 % perplexity
JOB_TIMEOUT_S = 600  # the longest job (Horovod dense, LSTM at 200 Mbit/s) takes about 2 minutes; longer is a hang


# ---- a worker: one scheme, one seed, in its own job -------------------------------------------
def warmup_steps(total_steps: int, args) -> int:
    """PowerSGD's dense start and our warm-ups: ``--warmup-fraction`` of the run's steps."""
    return max(2, int(args.warmup_fraction * total_steps))


def build(label: str, task, total_steps: int, args):
    """(model, optimizer, clip of the aggregate gradient or None) as the scheme's users build them."""
    import torch
    from schemes import ddp_powersgd, horovod_optimizer, our_optimizer

    scheme = parse(label)
    torch.manual_seed(args.seed)
    model = task.model()
    sgd = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.9)
    if scheme.torchrun:
        ddp = ddp_powersgd(model, start_iter=warmup_steps(total_steps, args),
                           one_bucket=scheme.peer == "ddp-powersgd-1bucket")
        return ddp, torch.optim.SGD(ddp.parameters(), lr=task.lr, momentum=0.9), task.clip
    if scheme.peer is not None:
        return model, horovod_optimizer(scheme, sgd, model), task.clip
    kw = scheme.kwargs(warmup_steps=warmup_steps(total_steps, args), clip=task.clip)
    return model, our_optimizer(sgd, model, kw), None if scheme.clips_locally(kw) else task.clip


def check_schemes(labels: list[str], args) -> None:
    """Parse every label before any job, and print what each resolved to; DDP alone (``ddp``,
    ``compute``) is no scheme to time to accuracy here."""
    lines = []
    for scheme in map(parse, labels):
        if scheme.peer in ("ddp", "compute"):
            raise SystemExit(f"--schemes {scheme.label}: bench_time_to_accuracy runs horovod, horovod-fp16, "
                             "ddp-powersgd, ddp-powersgd-1bucket and our schemes")
        lines.append(describe(scheme, None if not scheme.ours else
                              scheme.kwargs(warmup_steps=PerTask(f"<{args.warmup_fraction:g} of the steps>"),
                                            clip=PerTask("<the task's clip norm, if it clips>"))))
    print_resolved(lines)


def chosen(opt) -> dict:
    """What our optimizer settled on (density, dense, communicator); empty for the peers."""
    plan = getattr(opt, "plan", None)
    if plan is None or not hasattr(plan, "density"):
        return {}
    return {"density": plan.density, "dense": plan.dense, "communicator": opt.communicator.name,
            "target_density": opt.target_density}


def worker(args) -> None:
    import torch
    from bench_convergence import TASKS, fit

    if parse(args.scheme).torchrun:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size, leave = dist.get_rank(), dist.get_world_size(), dist.destroy_process_group

        def allsum(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t)
            return t
    else:
        if parse(args.scheme).ours:
            import horovod_safusion  # noqa: F401  imported before hvd.init(), as a user's script does
        import horovod.torch as hvd
        from bench_convergence import horovod_sum as allsum
        hvd.init()
        rank, size, leave = hvd.rank(), hvd.size(), hvd.shutdown
    torch.set_num_threads(1)
    with open(f"{args.result}.pid{rank}", "w") as f:  # for the driver: a worker reached over ssh is no child of its
        f.write(str(os.getpid()))
    task = TASKS[args.model](args, rank, size, allsum)
    model, opt, clip = build(args.scheme, task, task.steps_per_epoch() * task.epochs, args)
    t0 = time.perf_counter()
    run = fit(model, opt, clip, task, args.seed, args)
    run.update(wall=time.perf_counter() - t0, chosen=chosen(opt), workers=size)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(run, f)
    leave()


# ---- the driver -------------------------------------------------------------------------------
def commands(scheme: str, model: str, seed: int, result: str, prefix: list[str], hosts: int, args
             ) -> list[list[str]]:
    """The job's launcher commands (:func:`links.launchers`): torchrun for DDP, horovodrun for the
    rest, under ``prefix`` (a limited link's namespace) or on ``--hosts`` hosts of a cluster."""
    from bench_convergence import TRAINING_ARGS

    worker_cmd = [os.path.abspath(__file__), "--worker", "--model", model, "--scheme", scheme, "--seed", str(seed),
                  "--result", result,
                  *sum(([f"--{k.replace('_', '-')}", str(getattr(args, k))] for k in TRAINING_ARGS), [])]
    return launchers(worker_cmd, parse(scheme).torchrun, args.np, hosts, prefix)


def run_job(cmds: list[list[str]], result: str, log: str, timeout: float = JOB_TIMEOUT_S,
            env: dict[str, str] | None = None) -> dict:
    """Run one job (its commands side by side), with the label's environment ``env`` (e.g.
    ``PYTHONPATH`` of another tree); its result, or a record of why it failed."""
    codes = run_launchers(cmds, log, job_environ(OMP_NUM_THREADS="1", **(env or {})), timeout,
                          lambda: worker_pids(result))
    for name in glob.glob(f"{glob.escape(result)}.pid*"):
        os.remove(name)
    if codes is not None and not any(codes) and os.path.exists(result):
        with open(result) as f:
            return json.load(f)
    with open(log) as f:
        why = "a hang" if codes is None else f"exit {max(codes, key=abs)}"
        return {"failed": f"{why}: " + f.read()[-600:]}


def worker_pids(result: str) -> list[int]:
    """The pids the job's workers wrote beside ``result``."""
    pids = []
    for name in glob.glob(f"{glob.escape(result)}.pid*"):
        with open(name) as f:
            pids.append(int(f.read()))
    return pids


def reached(run: dict, target: float, higher: bool) -> dict | None:
    """The first evaluation of ``run`` at the target, or None."""
    return next((p for p in run["curve"] if (p["metric"] >= target if higher else p["metric"] <= target)), None)


def summarise(runs: dict, model: str, higher: bool) -> dict:
    """Target, and per scheme: time and steps to the target, final metric, seconds, ratios."""
    ok = {k: {s: r for s, r in by_seed.items() if "failed" not in r} for k, by_seed in runs.items()}
    dense = [r["final"] for r in ok.get("horovod", {}).values()]
    if not dense:
        return {"target": None, "rows": {}}
    base = float(np.median(dense))
    target = base - QUALITY[model] if higher else base * (1 + QUALITY[model])
    tta = {k: {s: (lambda h: None if h is None else h["seconds"])(reached(r, target, higher))
               for s, r in by_seed.items()} for k, by_seed in ok.items()}
    rows = {}
    for key, by_seed in runs.items():
        good = ok[key]
        hits = [tta[key][s] for s in good]
        finals = [r["final"] for r in good.values()]
        row = {"seeds": len(good), "failed": {s: r["failed"] for s, r in by_seed.items() if "failed" in r},
               "to_target_s": float(np.median(hits)) if hits and None not in hits else None,
               "to_target_range": [min(hits), max(hits)] if hits and None not in hits else None,
               "missed": [s for s in good if tta[key][s] is None],
               "to_target_steps": [(lambda h: None if h is None else h["step"])(reached(r, target, higher))
                                   for r in good.values()],
               "final": float(np.median(finals)) if finals else None,
               "final_range": [min(finals), max(finals)] if finals else None,
               "train_s": float(np.median([r["seconds"] for r in good.values()])) if good else None,
               "s_per_step": float(np.median([r["seconds"] / r["steps"] for r in good.values()])) if good else None,
               "eval_s": float(np.median([r["eval_seconds"] for r in good.values()])) if good else None,
               "cpu_per_step": float(np.median([r["cpu_seconds"] / r["steps"] for r in good.values()]))
               if good and all("cpu_seconds" in r for r in good.values()) else None,
               "chosen": [r.get("chosen") for r in good.values()],
               "one_bucket": {s: r["one_bucket"] for s, r in good.items() if "one_bucket" in r}}
        for other in ("horovod", "ddp-powersgd", "ddp-powersgd-1bucket", "safusion@0.01", "safusion@0.001+dgc"):
            pairs = [tta[other][s] / tta[key][s] for s in good
                     if s in tta.get(other, {}) and tta[other][s] is not None and tta[key][s] is not None]
            if pairs and key != other:
                row[f"vs_{other}"] = {"median": float(np.median(pairs)), "min": min(pairs), "max": max(pairs),
                                      "seeds": len(pairs)}
        rows[key] = row
    return {"dense_final": base, "target": target, "rows": rows}


def print_table(model: str, cell: str, s: dict, metric: str) -> None:
    if s["target"] is None:
        print(f"\n{model}, {cell}: dense Horovod has no finished run, so no target")
        return
    print(f"\n{model}, {cell}: {metric}; target {s['target']:.4g} (dense Horovod's median final "
          f"{s['dense_final']:.4g} {'− 1 point' if QUALITY[model] == 0.01 and model == 'digits' else '+ 3 %'})")
    print(f"{'scheme':<24} {'to target s [min–max]':>24} {'steps':>14} {'final [min–max]':>24} {'s/step':>7} "
          f"{'eval s':>7} {'CPU s/step':>10} {'Horovod/it':>11} {'PowerSGD/it':>12} {'PSGD-1b/it':>11}  chosen")
    for key, r in s["rows"].items():
        tt = "—" if r["to_target_s"] is None else \
            f"{r['to_target_s']:.1f} [{r['to_target_range'][0]:.1f}–{r['to_target_range'][1]:.1f}]"
        if r["missed"]:
            tt += f" (missed: seeds {r['missed']})"
        fin = "—" if r["final"] is None else f"{r['final']:.4f} [{r['final_range'][0]:.4f}–{r['final_range'][1]:.4f}]"
        vs = [(lambda v: "" if v is None else f"{v['median']:.2f}×")(r.get(f"vs_{o}"))
              for o in ("horovod", "ddp-powersgd", "ddp-powersgd-1bucket")]
        steps = ",".join("—" if x is None else str(x) for x in r["to_target_steps"])
        ch = "; ".join("dense" if c.get("dense") else f"{c.get('target_density'):g}/{c.get('communicator')}"
                       for c in r["chosen"] if c)
        cpu = "" if r["cpu_per_step"] is None else f"{r['cpu_per_step']:.3f}"
        label = f"{key} (1 bucket)" if r.get("one_bucket") else key
        print(f"{label:<24} {tt:>24} {steps:>14} {fin:>24} {r['s_per_step'] or 0:>7.3f} {r['eval_s'] or 0:>7.1f} {cpu:>10} "
              f"{vs[0]:>11} {vs[1]:>12} {vs[2]:>11}  {ch}")
        for seed, why in r["failed"].items():
            print(f"    seed {seed} failed: {reason(why)}")
        for seed, why in r.get("one_bucket", {}).items():
            print(f"    seed {seed} ran in one bucket: its default buckets failed ({why})")


def plot(results: dict, model: str, metric: str, higher: bool, path: str) -> None:
    """One panel per cell: quality against training seconds, every scheme."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(results)
    cols = min(2, len(cells))
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    # one colour per scheme in every panel, whatever schemes a cell lacks (a failed peer)
    keys = list(dict.fromkeys(k for cell in cells for k in results[cell]["runs"]))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {k: cycle[i % len(cycle)] for i, k in enumerate(keys)}
    for ax, cell in zip(axes.flat, cells):
        for key, by_seed in results[cell]["runs"].items():
            curves = [r["curve"] for r in by_seed.values() if "failed" not in r]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            t = np.median([[p["seconds"] for p in c[:n]] for c in curves], axis=0)
            m = np.array([[p["metric"] for p in c[:n]] for c in curves])
            label = f"{key} (1 bucket)" if any("one_bucket" in r for r in by_seed.values()) else key
            ax.plot(t, np.median(m, axis=0), label=label, color=colour[key], lw=2 if key == "safusion" else 1)
            ax.fill_between(t, m.min(axis=0), m.max(axis=0), color=colour[key], alpha=0.15)
        target = results[cell]["summary"]["target"]
        if target is not None:
            ax.axhline(target, color="k", ls=":", lw=1, label="target")
        ax.set_title(f"{model}, {cell}", fontsize=10)
        ax.set_xlabel("training seconds (evaluation excluded)")
        ax.set_ylabel(f"{metric} (median of seeds, min–max band)")
        if not higher:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cell_name(hosts: int, link: str, args) -> str:
    """A cell's name in tables, files and ``results.json``: ``"4 hosts, 100mbit"``."""
    return f"{hosts} hosts, {link}" if hosts else f"{args.np} workers, {link}"


def run_seed(scheme: str, model: str, seed: int, hosts: int, link: str, prefix: list[str], logs: str,
             longest: float, failed_before: dict, args) -> dict:
    """One scheme's job for one seed in one cell; ``ddp-powersgd`` whose default buckets fail (an
    abort, or a hang: :data:`HANG_FACTOR` times ``longest``) runs again in one bucket, saying so,
    and so does every later cell of the model (``failed_before``: model → why, filled here)."""
    def job(label: str, timeout: float) -> dict:
        where = f"{hosts}hosts" if hosts else f"{args.np}workers"
        name = re.sub(r"[^\w.=-]", "_", f"{model}_{where}_{link}_{seed}_{label}".replace("@", "_at_"))
        result, log = os.path.join(logs, name + ".json"), os.path.join(logs, name + ".log")
        if os.path.exists(result):
            os.remove(result)
        return run_job(commands(label, model, seed, result, prefix, hosts, args), result, log, timeout,
                       parse(label).env)

    if scheme != "ddp-powersgd":
        return job(scheme, JOB_TIMEOUT_S)
    if model in failed_before:
        why = f"they failed in an earlier cell: {failed_before[model]}"
    else:
        first = job(scheme, min(JOB_TIMEOUT_S, HANG_FACTOR * longest) if longest else JOB_TIMEOUT_S)
        if "failed" not in first:
            return first
        why = failed_before[model] = f"{cell_name(hosts, link, args)}: {reason(first['failed'])}"
    run = job(ONE_BUCKET, JOB_TIMEOUT_S)
    run["one_bucket"] = why
    return run


def reason(log_tail: str) -> str:
    """The line of a failed job's log that says why: a hang, an error, else the last line."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip().strip("=-*").strip()]
    said = [ln for ln in lines if "hang" in ln or "Error" in ln or "error" in ln or "abort" in ln.lower()]
    return (said or lines or [log_tail])[-1]


def drive(args) -> None:
    from tqdm import tqdm
    from bench_convergence import TASKS

    check_schemes(args.schemes, args)  # before any job
    for link in args.links:
        check_link(link)
    os.makedirs(args.out, exist_ok=True)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    results: dict = {}
    failed_before: dict = {}  # model → why ddp-powersgd's default buckets failed
    t_start = time.time()
    total = len(args.models) * len(args.hosts) * len(args.links) * len(args.seeds) * len(args.schemes)
    with tqdm(total=total, desc="jobs", dynamic_ncols=True) as bar:
        for model in args.models:
            results[model] = {}
            for hosts in args.hosts:
                for link in args.links:
                    cell = cell_name(hosts, link, args)
                    runs: dict = {k: {} for k in args.schemes}
                    longest = 0.0
                    with (cluster(hosts, link) if hosts else limited_link(link)) as prefix:
                        for i, seed in enumerate(args.seeds):
                            order = args.schemes[i % len(args.schemes):] + args.schemes[:i % len(args.schemes)]
                            for scheme in order:
                                bar.set_postfix_str(f"{model}, {cell}, seed {seed}, {scheme}")
                                t0 = time.time()
                                runs[scheme][seed] = run_seed(scheme, model, seed, hosts, link, prefix, logs,
                                                              longest, failed_before, args)
                                if "failed" not in runs[scheme][seed]:
                                    longest = max(longest, time.time() - t0)
                                bar.update()
                    task = TASKS[model]
                    summary = summarise(runs, model, task.higher_is_better)
                    results[model][cell] = {"runs": runs, "summary": summary}
                    tqdm.write("")
                    print_table(model, cell, summary, task.metric)
                    plot(results[model], model, task.metric, task.higher_is_better,
                         os.path.join(args.out, f"tta_{model}.png"))
                    with open(os.path.join(args.out, "results.json"), "w") as f:
                        json.dump({"args": vars(args), "minutes": (time.time() - t_start) / 60, "results": results},
                                  f, indent=1)
    print(f"\n{(time.time() - t_start) / 60:.1f} minutes; wrote {args.out}/results.json and tta_*.png")


def main() -> None:
    from bench_convergence import add_training_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["digits", "lstm"], choices=["digits", "lstm"])
    ap.add_argument("--links", nargs="+", default=["100mbit", "1gbit"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    ap.add_argument("--hosts", nargs="+", type=int, default=[2, 4, 8],
                    help="hosts of a cluster on one machine (scripts/cluster.sh), one worker each, every host's "
                         "link limited to --links; a cell per count (0: --np workers on this host instead)")
    ap.add_argument("--np", type=int, default=2, help="workers on one host, with --hosts 0")
    add_training_args(ap)
    ap.set_defaults(digits_width=64)  # 145 k weights: a CNN that a 100 Mbit/s link holds back (the demo's)
    ap.add_argument("--out", default="out/bench_tta")
    # a worker's own arguments (the driver passes them)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
