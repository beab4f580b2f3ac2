"""GPU kernels against their PyTorch path: selection and decode throughput beside memory bandwidth.

    python benchmarks/bench_gpu_kernels.py [--sizes 1e6 1e7 1e8 --densities 0.01 0.001]

Needs a CUDA device (``--device cpu`` runs a small smoke test of the same code, the Triton kernels
through Triton's interpreter: correctness of the script, not speed). For each buffer size and
density, a buffer of 16 equal segments of normal values with per-segment thresholds at the
density's quantile goes through the device path's selection — statistics, compare-and-count,
one host read, compaction into the wire rows — and the rows of 4 ranks through decode, with the
Triton kernels and with the PyTorch path alternately, ``--alternations`` times (these machines
drift, so ratios are taken per alternation). Throughput is the buffer's bytes (selection) or the
rows' bytes (decode) per second; the device's bandwidth is measured by a device-to-device copy.
Memory: the peak that one selection and one decode allocate beyond the buffer they work on
(``torch.cuda.max_memory_allocated``), as a multiple of the buffer's bytes. It prints a table
and writes ``gpu_kernels.png`` and ``results.json`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from horovod_safusion import kernels, memory
from horovod_safusion.segment import Segments

SEGMENTS = 16


def _timer(device: torch.device):
    """Seconds of a callable on ``device`` (CUDA events on a GPU)."""
    def timed(fn, repeat: int) -> float:
        fn()  # warm: compilation, caches
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                fn()
            stop.record()
            torch.cuda.synchronize()
            return start.elapsed_time(stop) / 1e3 / repeat
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t) / repeat
    return timed


def bandwidth(device: torch.device, timed, numel: int = 1 << 27) -> float:
    """Bytes per second of a device-to-device copy (read + write)."""
    src = torch.empty(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 10)


def case(numel: int, density: float, device: torch.device, dtype: torch.dtype):
    """A buffer, its segments' block table and thresholds selecting about ``density``."""
    size = numel // SEGMENTS
    segments = Segments(tuple(f"s{i}" for i in range(SEGMENTS)), (size,) * SEGMENTS, device)
    g = torch.Generator(device=device).manual_seed(0)
    flat = torch.randn(size * SEGMENTS, generator=g, device=device, dtype=torch.float32).to(dtype)
    thr = torch.full((SEGMENTS,), float(torch.special.ndtri(torch.tensor(1 - density / 2))), device=device).to(dtype)
    return flat, kernels.block_table(segments, device), thr


def select(flat: torch.Tensor, table, thr: torch.Tensor, work: torch.Tensor | None = None) -> torch.Tensor:
    """The device path of one buffer: statistics, compare-and-count, one host read, compaction
    (on a copy of ``flat``, ``work`` if given, since the selection takes what it sends out)."""
    work = flat.clone() if work is None else work.copy_(flat)
    kernels.segment_stats(work, table)
    sel = kernels.selection(work, thr, table)
    return sel.take(int(sel.total))[2]


def decode(rows: torch.Tensor, out: torch.Tensor) -> None:
    """Decode as the communicators do: into one target tensor per segment (the gradients)."""
    size = out.numel() // SEGMENTS
    out.zero_()
    kernels.decode_rows(rows, tuple(out.split(size)), np.arange(SEGMENTS + 1) * size)


def peak_extra(fn, device: torch.device) -> int:
    """Bytes that ``fn`` allocates at its peak beyond what is allocated when it starts (its
    workspaces and outputs): ``torch.cuda.max_memory_allocated`` on a GPU, the rise of the
    resident set on the CPU (page-granular, for the smoke test)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    base = memory.resident()
    memory.reset_peak()
    fn()
    return max(0, memory.rss()["hwm"] - base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    ap.add_argument("--ranks", type=int, default=4, help="ranks whose rows are decoded")
    ap.add_argument("--alternations", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="out/bench_gpu_kernels")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run this on a GPU machine (or --device cpu for a smoke test)")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.sizes, args.repeat, args.alternations = [2e4], 1, 1
    dtype = getattr(torch, args.dtype)
    timed = _timer(device)
    peak = bandwidth(device, timed, 1 << 20 if device.type == "cpu" else 1 << 27)
    rows_out = []
    total = len(args.sizes) * len(args.densities) * args.alternations * 2
    with tqdm(total=total, desc="kernels", file=sys.stderr) as bar:
        for size in args.sizes:
            for density in args.densities:
                flat, table, thr = case(int(size), density, device, dtype)
                samples = {"triton": {"select": [], "decode": []}, "torch": {"select": [], "decode": []}}
                extra = {"triton": {}, "torch": {}}
                work = torch.empty_like(flat)
                for _ in range(args.alternations):
                    for backend in ("triton", "torch"):
                        os.environ["HOROVOD_SAFUSION_KERNELS"] = backend
                        kernels.reread()
                        rows = select(flat, table, thr)
                        gathered = torch.cat([rows] * args.ranks)
                        out = torch.zeros(flat.numel(), dtype=dtype, device=device)
                        extra[backend]["select"] = peak_extra(lambda: select(flat, table, thr, work), device)
                        extra[backend]["decode"] = peak_extra(lambda: decode(gathered, out), device)
                        samples[backend]["select"].append(timed(lambda: select(flat, table, thr), args.repeat))
                        samples[backend]["decode"].append(timed(lambda: decode(gathered, out), args.repeat))
                        bar.update()
                buffer_bytes = flat.numel() * flat.element_size()
                row_bytes = gathered.numel()
                rec = {"numel": flat.numel(), "density": density, "selected": rows.shape[0],
                       "peak_GBps": peak / 1e9}
                for backend, s in samples.items():
                    rec[f"{backend}_select_GBps"] = buffer_bytes / float(np.median(s["select"])) / 1e9
                    rec[f"{backend}_decode_GBps"] = row_bytes / float(np.median(s["decode"])) / 1e9
                    for op in ("select", "decode"):  # peak memory beyond the buffer, x the buffer
                        rec[f"{backend}_{op}_extra"] = extra[backend][op] / buffer_bytes
                for op in ("select", "decode"):
                    ratio = np.array(samples["torch"][op]) / np.array(samples["triton"][op])
                    rec[f"{op}_speedup"] = [float(np.median(ratio)), float(ratio.min()), float(ratio.max())]
                rows_out.append(rec)
    os.environ.pop("HOROVOD_SAFUSION_KERNELS", None)
    kernels.reread()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter: not a speed)"
    print(f"\n{name}; copy bandwidth {peak / 1e9:.0f} GB/s; {args.dtype}; decode of {args.ranks} ranks' rows")
    print(f"{'elements':>11} {'density':>8} | {'select GB/s triton':>18} {'torch':>7} {'speedup [min-max]':>20} "
          f"| {'decode GB/s triton':>18} {'torch':>7} {'speedup [min-max]':>20} "
          f"| {'peak memory x buffer: select triton':>35} {'torch':>6} {'decode triton':>13} {'torch':>6}")
    for r in rows_out:
        s, d = r["select_speedup"], r["decode_speedup"]
        print(f"{r['numel']:>11} {r['density']:>8} | {r['triton_select_GBps']:>18.1f} {r['torch_select_GBps']:>7.1f} "
              f"{s[0]:>8.2f} [{s[1]:.2f}-{s[2]:.2f}] | {r['triton_decode_GBps']:>18.1f} {r['torch_decode_GBps']:>7.1f} "
              f"{d[0]:>8.2f} [{d[1]:.2f}-{d[2]:.2f}] | {r['triton_select_extra']:>35.3f} "
              f"{r['torch_select_extra']:>6.3f} {r['triton_decode_extra']:>13.3f} {r['torch_decode_extra']:>6.3f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"device": name, "dtype": args.dtype, "rows": rows_out}, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op in zip(axes, ("select", "decode")):
        for density in args.densities:
            pts = [r for r in rows_out if r["density"] == density]
            for backend, style in (("triton", "-o"), ("torch", "--s")):
                ax.plot([r["numel"] for r in pts], [r[f"{backend}_{op}_GBps"] for r in pts], style,
                        label=f"{backend}, density {density}")
        ax.axhline(peak / 1e9, color="grey", lw=0.8, label="copy bandwidth")
        ax.set(xscale="log", xlabel="buffer elements", ylabel="GB/s", title=op)
        ax.legend(fontsize=7)
    fig.suptitle(name)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "gpu_kernels.png"), dpi=120)
    print(f"wrote {args.out}/results.json and gpu_kernels.png")


if __name__ == "__main__":
    main()
