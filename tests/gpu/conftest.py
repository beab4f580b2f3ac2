"""``tests/gpu``: the device path on a CUDA device (``test_cuda_kernels.py`` says what is checked).

Before the test module is imported, this file

* loads ``horovod_safusion`` without its ``__init__`` where Horovod is not installed, as on the GPU
  machines lent to this project: the kernels and the device-path compressors do not need Horovod,
  only the package's ``__init__`` does (:mod:`gpu_env` says why and how; Horovod is not faked);
* puts ``tests/unit`` on the path, so that the GPU tests reuse the CPU tests' cases and helpers;
* has Triton compile its kernels for the GPU: ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` for
  the CPU suite, and a Triton kernel is interpreted or compiled for good when it is defined. When
  this process runs nothing but ``tests/gpu`` on a machine with CUDA, the variable is set to ``0``
  here, before any kernel is defined; when it runs the CPU suite too, the interpreter stays (the
  CPU tests need it) and the CUDA tests skip, saying to run ``tests/gpu`` alone.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))

import gpu_env  # noqa: E402

gpu_env.install()


def _only_this_folder(config) -> bool:
    """Whether every path this pytest run was given lies in ``tests/gpu``."""
    base = str(config.invocation_params.dir)
    paths = [os.path.abspath(os.path.join(base, a.split("::")[0])) for a in config.args] or [base]
    return all(os.path.commonpath([p, HERE]) == HERE for p in paths)


def pytest_configure(config):
    if gpu_env.device_name() != "cuda" or "horovod_safusion.kernels.triton_ops" in sys.modules:
        return
    import torch
    if torch.cuda.is_available() and _only_this_folder(config):
        os.environ["TRITON_INTERPRET"] = "0"


def pytest_terminal_summary(terminalreporter):
    if gpu_env.SYNCS:
        terminalreporter.section("synchronising CUDA calls per buffer (CUDA's sync debug mode)")
        for line in gpu_env.SYNCS:
            terminalreporter.write_line(line)
