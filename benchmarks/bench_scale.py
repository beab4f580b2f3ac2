"""How the schemes scale with the number of hosts: ``bench_peers`` on a cluster on one machine.

    python benchmarks/bench_scale.py [--hosts 2 4 8] [--links 1gbit 200mbit] [--models resnet18 lstm]
                                     [--alternations 3] [bench_peers' other options]

Compute alone, Horovod, DDP + PowerSGD and ours (the default, and each communicator forced sparse:
``allgather``, ``spardl``, ``zen`` with ``dense=False``, so that their rows compare the protocols
and not each job's own choice of dense), at P hosts of one worker each (``scripts/cluster.sh``: a network
namespace per host with its own link of the given rate both ways, its own sshd; root), each
peer launched as its users launch it: ``horovodrun -H h1:1,...`` from host 1 over ssh, and one
``torch.distributed.run`` per host meeting at host 1 for compute and DDP. The method is
``bench_peers``'s (interleaved alternations, one job per scheme stopped between its turns) and so
are its tables per (P, link, model). Bytes received per worker are read from the worker's host
interface (``/sys/class/net/sfnet/statistics/rx_bytes``, the most any host received per step):
measured for every scheme, peers included.

What runs by default, chosen to keep the run short on a 2-core machine (each part's duration,
measured in a full run, and whether the whole fits in an hour: docs/benchmarks.md, "Across
hosts"): P = 2, 4 and 8 at 1 Gbit/s per host, where ``bench_scale_out`` fits its cost model, and
the schemes above. Left out, and run by giving ``--links``, ``--schemes`` or ``--skip``:
200 Mbit/s (the peers' gap is widest there, but each link costs the run again), Horovod with
``Compression.fp16``, plain DDP (a dense allreduce, as Horovod's), ours forced dense
(``safusion:dense=true``; the default measures dense against sparse in its own trial) and
ExDyna's communicator (its own compressor, measured by
``bench_compressors`` and ``bench_convergence``). A scheme that fails at a smaller P on a model
is not launched at the larger ones (``bench_peers``; ``--relaunch-failed`` launches it anyway).

Sizes, so that 8 workers fit 2 cores' memory and time: CIFAR ResNet-18 at width 32 (2.8 M weights)
and the LSTM language model at 256 units (6.2 M weights, vocabulary 10000), batch 16 per worker.
Every worker shares this machine's cores, so compute per worker slows as P grows: the scaling
factor (compute alone at the same P ÷ the scheme) is what compares across P.

It adds a summary per model and link — s/iteration, scaling factor and bytes received against P
per scheme — as a table, ``scale.json`` and ``bench_scale.png`` in ``--out``.
"""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_peers  # noqa: E402

SCHEMES = ["compute", "horovod", "ddp-powersgd", "safusion", "safusion:communicator=allgather:dense=false",
           "safusion:communicator=spardl:dense=false", "safusion:communicator=zen:dense=false"]
DEFAULTS = ["--hosts", "2", "4", "8", "--links", "1gbit", "--width", "32", "--hidden", "256",
            "--alternations", "3", "--out", "out/bench_scale", "--schemes", *SCHEMES]


def with_defaults(argv: list[str]) -> list[str]:
    """``argv`` with :data:`DEFAULTS` for every option it does not give."""
    given = {a for a in argv if a.startswith("--")}
    out, i = [], 0
    while i < len(DEFAULTS):
        j = next((k for k in range(i + 1, len(DEFAULTS)) if DEFAULTS[k].startswith("--")), len(DEFAULTS))
        if DEFAULTS[i] not in given:
            out += DEFAULTS[i:j]
        i = j
    return out + argv


def scale_table(results_path: str) -> dict:
    """Per model and link rate: per scheme, against P, the median s/iteration, scaling factor and
    bytes received per worker per step."""
    with open(results_path) as f:
        summary = json.load(f)["summary"]
    table: dict = {}
    for model, by_label in summary.items():
        for label, s in by_label.items():
            hosts, rate = label.split("x", 1)
            for key, row in s["schemes"].items():
                cell = {"wall": row["wall"]["median"], "cpu": row["cpu"]["median"],
                        "scaling": row.get("scaling", {}).get("median"),
                        "received": row.get("received", {}).get("median")}
                table.setdefault(model, {}).setdefault(rate, {}).setdefault(key, {})[int(hosts)] = cell
            for key, why in s["failed"].items():
                table.setdefault(model, {}).setdefault(rate, {}).setdefault(key, {})[int(hosts)] = {"failed": why}
    return table


def print_table(table: dict) -> None:
    for model, by_rate in table.items():
        for rate, by_scheme in by_rate.items():
            ps = sorted({p for cells in by_scheme.values() for p in cells})
            print(f"\n{model}, {rate} per host: s/iteration | scaling factor | MB received per worker per step, "
                  f"at P = {', '.join(map(str, ps))}")
            for key, cells in by_scheme.items():
                parts = []
                for p in ps:
                    c = cells.get(p)
                    if c is None:
                        parts.append("-")
                    elif "failed" in c:
                        parts.append("failed")
                    else:
                        sc = "-" if c["scaling"] is None else f"{c['scaling']:.2f}"
                        mb = "-" if c["received"] is None else f"{c['received'] / 1e6:.2f}"
                        parts.append(f"{c['wall']:.3f} | {sc} | {mb}")
                print(f"  {key:<48}" + "".join(f"{x:>26}" for x in parts))


def plot(table: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, r) for m, by_rate in table.items() for r in by_rate]
    fig, axes = plt.subplots(2, len(panels), figsize=(5.5 * len(panels), 8), squeeze=False)
    for col, (model, rate) in enumerate(panels):
        for key, cells in table[model][rate].items():
            ps = sorted(p for p, c in cells.items() if "failed" not in c)
            if not ps:
                continue
            style = dict(marker="o", lw=2 if key.startswith("safusion") else 1,
                         ls="-" if key.startswith("safusion") else "--")
            axes[0][col].plot(ps, [cells[p]["wall"] for p in ps], label=key, **style)
            got = [p for p in ps if cells[p]["received"] is not None]
            if got:
                axes[1][col].plot(got, [cells[p]["received"] / 1e6 for p in got], label=key, **style)
        axes[0][col].set_title(f"{model}, {rate} per host", fontsize=10)
        axes[0][col].set_ylabel("s/iteration (median)")
        axes[1][col].set_ylabel("MB received per worker per step")
        for ax in axes[:, col]:
            ax.set_xlabel("hosts P (one worker each)")
            ax.set_xscale("log", base=2)
        axes[0][col].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    started = time.time()
    argv = with_defaults(sys.argv[1:])
    sys.argv = [os.path.join(HERE, "bench_peers.py"), *argv]
    bench_peers.main()
    out = os.path.abspath(argv[argv.index("--out") + 1])
    table = scale_table(os.path.join(out, "results.json"))
    print_table(table)
    with open(os.path.join(out, "scale.json"), "w") as f:
        json.dump(table, f, indent=1)
    plot(table, os.path.join(out, "bench_scale.png"))
    print(f"wrote {out}/scale.json, bench_scale.png; {(time.time() - started) / 60:.1f} minutes in all")


if __name__ == "__main__":
    main()
