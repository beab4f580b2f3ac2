"""What one round of SparDL's and ZEN's protocols costs on each transport: Horovod's alltoall or Gloo's send/recv.

    python benchmarks/bench_rounds.py [--hosts 4 8] [--links 1gbit 200mbit] [--np 3]   (as root)
    horovodrun -np 3 -H localhost:3 --gloo python benchmarks/bench_rounds.py --worker --out out/bench_rounds

SparDL (§3.1, Algorithm 1) runs 2⌈log2 P⌉ rounds per buffer, ZEN's Hierarchical Centralization
(§2.3) ⌈log2 P⌉ or more; each round is a point-to-point message per worker
(``horovod_safusion.communicators.rounds``). This benchmark times the round itself: every worker
sends ``n`` wire rows to the next worker and receives as many from the previous one (a ring, the
shape of SparDL's rounds), over ``HorovodRounds`` (one ``hvd.alltoall`` with splits) and
``GlooRounds`` (Gloo send/recv on a group beside Horovod), for several ``n``.

Each configuration is one ``horovodrun`` job: ``--np`` workers on this host's loopback, or one
worker on each of ``--hosts`` hosts of a cluster on one machine (``scripts/cluster.sh``) whose
every host's link is limited to ``--links``. In a job the transports alternate (``--alternations``
blocks, the order turning each block, ``--rounds`` rounds per block and size); a round's time is the
slowest worker's, the block's the median over its rounds. The table gives per transport and size
the median over blocks with its min–max, the median of the per-block ratio Horovod ÷ Gloo, CPU
seconds per round (this worker's process time, median), and a fit of latency + bytes / bandwidth
per transport (``numpy.polyfit`` of the medians). PNG and JSON go to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from links import check_link, cluster, job_environ, launchers, limited_link, run_job  # noqa: E402

ROW_BYTES = 8  # a float32 value and an int32 index (horovod_safusion.wire)
JOB_TIMEOUT_S = 900


def worker(args) -> None:
    import torch
    import horovod_safusion  # noqa: F401  before hvd.init(), as a user's script: Horovod's cycle time as the plugin sets it
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    from horovod_safusion.communicators.rounds import gloo_rounds

    ps = hvd.global_process_set
    me, size = hvd.rank(), hvd.size()
    gloo = gloo_rounds(ps)
    transports = {"horovod": gloo.fallback, "gloo": gloo}
    samples = []  # (block, transport, rows, seconds, cpu seconds)
    for block in range(args.alternations):
        order = list(transports) if block % 2 == 0 else list(transports)[::-1]
        for name in order:
            for n in args.rows:
                rows = torch.zeros((n, ROW_BYTES), dtype=torch.uint8)
                times, cpu = [], []
                for i in range(args.rounds + 1):
                    c0, t0 = time.process_time(), time.perf_counter()
                    transports[name].start({(me + 1) % size: rows}, [(me - 1) % size],
                                           f"bench.rounds.{block}.{name}.{n}.{i}", rows[:0]).wait()
                    if i:  # the first round of a block warms up
                        times.append(time.perf_counter() - t0)
                        cpu.append(time.process_time() - c0)
                slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max,
                                        name=f"bench.rounds.max.{block}.{name}.{n}")
                samples.append((block, name, n, float(np.median(slowest.numpy())), float(np.median(cpu))))
    if me == 0:
        with open(os.path.join(args.out, "job.json"), "w") as f:
            json.dump({"workers": size, "samples": samples}, f)


def summarise(samples: list, rows: list[int]) -> dict:
    by = {}
    for block, name, n, sec, cpu in samples:
        by.setdefault((name, n), []).append((block, sec, cpu))
    out = {}
    for n in rows:
        hv = {b: s for b, s, _ in by[("horovod", n)]}
        gl = {b: s for b, s, _ in by[("gloo", n)]}
        ratios = [hv[b] / gl[b] for b in hv if b in gl]
        for name in ("horovod", "gloo"):
            secs = [s for _, s, _ in by[(name, n)]]
            out[(name, n)] = {"median": float(np.median(secs)), "min": float(min(secs)), "max": float(max(secs)),
                              "cpu": float(np.median([c for _, _, c in by[(name, n)]]))}
        out[("ratio", n)] = {"median": float(np.median(ratios)), "min": float(min(ratios)), "max": float(max(ratios))}
    for name in ("horovod", "gloo"):
        slope, intercept = np.polyfit([n * ROW_BYTES for n in rows], [out[(name, n)]["median"] for n in rows], 1)
        out[(name, "fit")] = {"latency_ms": 1e3 * intercept, "mbit_s": 8e-6 / slope if slope > 0 else float("inf")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="*", default=[], help="cluster sizes (one worker per host)")
    ap.add_argument("--links", nargs="+", default=["1gbit"], help="per host (cluster) or for the namespace (--np)")
    ap.add_argument("--np", type=int, nargs="*", default=[3], help="workers on this host (loopback or --links)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 1000, 30000])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--alternations", type=int, default=6)
    ap.add_argument("--out", default="out/bench_rounds")
    ap.add_argument("--worker", action="store_true", help="run as one job's worker (under horovodrun)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.worker:
        return worker(args)
    for link in args.links:
        check_link(link)
    from tqdm import tqdm

    configs = [(0, n, link) for n in args.np for link in args.links] + [(h, 1, link) for h in args.hosts for link in args.links]
    results = []
    for hosts, np_, link in tqdm(configs, desc="jobs"):
        label = f"{hosts} hosts" if hosts else f"{np_} workers, one host"
        job_out = os.path.join(args.out, f"{hosts}h{np_}w-{link}")
        os.makedirs(job_out, exist_ok=True)
        worker_cmd = [os.path.abspath(__file__), "--worker", "--out", job_out, "--rounds", str(args.rounds),
                      "--alternations", str(args.alternations), "--rows", *map(str, args.rows)]
        with (cluster(hosts, link) if hosts else limited_link(link)) as prefix:
            codes = run_job(launchers(worker_cmd, False, np_, hosts, prefix), os.path.join(job_out, "log.txt"),
                            job_environ(OMP_NUM_THREADS="1"), JOB_TIMEOUT_S)
            rc = -1 if codes is None else max(map(abs, codes))
        if rc:
            print(f"{label}, {link}: the job failed ({rc}); see {job_out}/log.txt", file=sys.stderr)
            continue
        with open(os.path.join(job_out, "job.json")) as f:
            job = json.load(f)
        results.append({"label": label, "link": link, "workers": job["workers"],
                        "summary": summarise(job["samples"], args.rows)})
    print_table(results, args.rows)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "results": [{**r, "summary": {f"{k[0]}@{k[1]}": v for k, v in r["summary"].items()}}
                                                   for r in results]}, f, indent=1)
    plot(results, args.rows, os.path.join(args.out, "rounds.png"))
    print(f"wrote {args.out}/results.json, rounds.png")


def print_table(results: list[dict], rows: list[int]) -> None:
    print("\nseconds per round, slowest worker (median over blocks [min–max]); Horovod ÷ Gloo per block")
    print(f"{'job':<22} {'link':<9} {'rows':>7} | {'horovod ms':>22} {'cpu ms':>7} | {'gloo ms':>22} {'cpu ms':>7} | "
          f"{'hvd ÷ gloo':>18}")
    for r in results:
        s = r["summary"]
        for n in rows:
            h, g, q = s[("horovod", n)], s[("gloo", n)], s[("ratio", n)]
            print(f"{r['label']:<22} {r['link']:<9} {n:>7} | {1e3 * h['median']:>7.2f} [{1e3 * h['min']:.2f}–{1e3 * h['max']:.2f}]"
                  f" {1e3 * h['cpu']:>7.2f} | {1e3 * g['median']:>7.2f} [{1e3 * g['min']:.2f}–{1e3 * g['max']:.2f}]"
                  f" {1e3 * g['cpu']:>7.2f} | {q['median']:>6.2f} [{q['min']:.2f}–{q['max']:.2f}]")
        fits = ", ".join(f"{name}: {s[(name, 'fit')]['latency_ms']:.2f} ms + " +
                         (f"bytes / {s[(name, 'fit')]['mbit_s']:.0f} Mbit/s" if np.isfinite(s[(name, 'fit')]['mbit_s'])
                          else "bytes / (no bandwidth term above the noise)") for name in ("horovod", "gloo"))
        print(f"{'':<22} fit  {fits}")


def plot(results: list[dict], rows: list[int], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        for name, style in (("horovod", "o-"), ("gloo", "s--")):
            ax.plot([n * ROW_BYTES for n in rows], [1e3 * r["summary"][(name, n)]["median"] for n in rows], style,
                    label=f"{r['label']}, {r['link']}: {name}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per worker per round")
    ax.set_ylabel("ms per round (slowest worker)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
