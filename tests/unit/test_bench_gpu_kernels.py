"""``benchmarks/bench_gpu_kernels.py`` keeps running: its CPU smoke test (the Triton kernels under
the interpreter, tiny sizes) goes through selection, decode and the memory columns, so that a change
of a kernel's signature cannot leave the GPU benchmark broken until a GPU is lent."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_smoke_run_writes_speed_and_memory_for_both_paths(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu_kernels.py"), "--device", "cpu",
                           "--densities", "0.01", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.load(open(tmp_path / "results.json"))["rows"]
    assert len(rows) == 1 and rows[0]["selected"] > 0
    for backend in ("triton", "torch"):
        for op in ("select", "decode"):
            assert rows[0][f"{backend}_{op}_GBps"] > 0
            assert rows[0][f"{backend}_{op}_extra"] >= 0
    assert (tmp_path / "gpu_kernels.png").exists()
