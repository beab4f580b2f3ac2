"""Where the GPU tests and ``benchmarks/gpu_check.sh`` run: the package without Horovod, and which
device the tests use.

The device path (``horovod_safusion.kernels``, ``horovod_safusion.compressors``, ``segment``,
``wire``, ``memory``) needs torch, NumPy, SciPy, Numba and Triton, not Horovod, and the GPU
machines lent to this project have no Horovod (nor the time to build it). Only the package's
``__init__`` stands in the way: it imports the optimizer, the communicators and the rest, which
need Horovod. Where Horovod is not installed, :func:`install` registers a *bare*
``horovod_safusion`` package module instead, its ``__path__`` pointing at the package folder and
its ``__init__`` not run, so that the subpackages load as they are. Horovod itself is not faked:
whatever does need it (the optimizer, the communicators) still fails to import there, as it
should. Where Horovod is installed nothing changes (``SAFUSION_BARE_PACKAGE=1`` forces the bare
package, to check it on a machine with Horovod).

Run as a script, it installs the bare package and runs another script as ``__main__``::

    python3 tests/gpu/gpu_env.py benchmarks/bench_gpu_kernels.py --device cuda ...

``SAFUSION_GPU_TESTS_DEVICE`` picks the device of ``tests/gpu`` (``cuda`` by default; ``cpu`` runs
the same checks on CPU tensors, the device path forced and Triton interpreted — a dry run of the
tests' code where no GPU is lent).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "horovod_safusion"

#: Lines for the end of the test run: synchronisations per buffer, per compressor and kernels
#: (``test_cuda_kernels.test_one_synchronisation_per_buffer`` adds them, ``conftest.py`` prints them).
SYNCS: list[str] = []


def horovod_missing() -> bool:
    """Whether Horovod cannot be imported here (looked up, not imported: importing it loads MPI)."""
    return importlib.util.find_spec("horovod") is None


def install() -> bool:
    """Register the bare package where Horovod is missing (or ``SAFUSION_BARE_PACKAGE=1``);
    whether it did. A no-op once the package is imported."""
    if PACKAGE in sys.modules:
        return False
    if not (horovod_missing() or os.environ.get("SAFUSION_BARE_PACKAGE") == "1"):
        return False
    folder = os.path.join(ROOT, PACKAGE)
    spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [folder]
    module = types.ModuleType(PACKAGE, "horovod_safusion without its __init__ (no Horovod here): tests/gpu/gpu_env.py")
    module.__spec__, module.__path__, module.__package__ = spec, [folder], PACKAGE
    sys.modules[PACKAGE] = module
    return True


def device_name() -> str:
    """``cuda`` (the default) or ``cpu``, from ``SAFUSION_GPU_TESTS_DEVICE``."""
    name = os.environ.get("SAFUSION_GPU_TESTS_DEVICE", "cuda")
    if name not in ("cuda", "cpu"):
        raise ValueError(f"SAFUSION_GPU_TESTS_DEVICE must be cuda or cpu, got {name!r}")
    return name


def warm_host() -> None:
    """Compile the host path's Numba kernels for float32 and float64 (Numba caches them on disk),
    running the CPU tests' compressor case on the host path: ``benchmarks/gpu_check.sh`` does this
    in the background while the GPU tests compile and run their Triton kernels, so that the
    compressor tests, which compare with the host path, find them compiled."""
    install()
    os.environ["HOROVOD_SAFUSION_DEVICE_PATH"] = "0"
    sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
    import torch
    import test_compressors as C
    from horovod_safusion.compressors import make_compressor

    for dtype in (torch.float32, torch.float64):
        for name in C.THRESHOLD_COMPRESSORS:
            C._carried(name, dtype=dtype)
    segments, flat = C.gaussian_segments()
    for name in ("topk", "randomk"):
        make_compressor(name, 0.01).select(flat, segments, 0)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: gpu_env.py SCRIPT [ARGS...] | --warm-host")
    if argv[0] == "--warm-host":
        warm_host()
        return
    install()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
