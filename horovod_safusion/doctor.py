"""``python -m horovod_safusion doctor``: what this environment gives the plugin, and what to fix.

In the spirit of ``horovodrun --check-build``, one finding per line: Horovod's version and what it
was built with, torch and its devices, the CPU selection kernels that Numba compiles, Triton, the
cycle time in force with who chose it, and whether the package loads its kernels at import. Each
finding is ``ok``, ``warning`` (the plugin runs, slower or untested) or ``fatal`` (it cannot run),
and every warning and fatal finding says what to do. The doctor only looks: it initialises no
Horovod and compiles no kernel.

Each check gathers facts (importing what it inspects, inside the check) and judges them in a pure
function, so that the judgement is tested on facts made up for it. Importing the package needs
Horovod, torch and Numba, and ``python -m horovod_safusion`` imports the package before its
``__main__``; so this module imports nothing at its top that needs them, and the package's
``__init__`` hands a failed import to :func:`fallback`, which reports instead of the traceback.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from . import cycle, launcher
from .requirements import SUPPORTED_HOROVOD

OK, WARNING, FATAL = "ok", "warning", "fatal"

INSTALL_HOROVOD = ("`make install` in a clone of horovod-safusion builds it (scripts/install.sh); elsewhere, "
                   "build Horovod against this torch with HOROVOD_WITH_PYTORCH=1 and C++17, as that script does")
WARM_UP = ("python -c 'from horovod_safusion.compressors.segmented import warm_up; warm_up(); "
           "from horovod_safusion.kernels.host import warm_up; warm_up()'")


@dataclass(frozen=True)
class Finding:
    """One line of the report: what was checked, how it stands, what was found, what to do."""

    check: str
    level: str
    found: str
    advice: str = ""


@dataclass(frozen=True)
class HorovodFacts:
    """``version``: ``horovod.__version__`` (``None``: ``horovod`` does not import); ``error``: why
    ``horovod`` or ``horovod.torch`` does not import; ``built``: what ``horovod.torch``'s
    ``*_built()`` functions answer, by name."""

    version: str | None = None
    error: str = ""
    built: Mapping[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadingFacts:
    """The switch of the selection kernels' loading at import
    (:data:`~horovod_safusion.compressors.loading.ON_IMPORT_ENV`): its name, its value (``None``:
    unset), whether it leaves the loading on (``None``: a value the import refuses) and the job's
    worker count as the launcher tells it; ``error``: why
    :mod:`~horovod_safusion.compressors.loading` does not import."""
    env: str = ""
    value: str | None = None
    on: bool | None = True
    workers: int = 1
    error: str = ""


@dataclass(frozen=True)
class TorchFacts:
    """``version`` (``None``: torch does not import, ``error`` says why) and the CUDA devices' names."""

    version: str | None = None
    error: str = ""
    cuda: Sequence[str] = ()


@dataclass(frozen=True)
class NumbaFacts:
    """``version`` (``None``: Numba does not import); of the ``kernels`` compiled functions of the
    host path, how many Numba's cache holds for this machine and their source; ``error``: why
    Numba or its cache could not be read; ``unchecked``: why the kernels' modules did not import."""

    version: str | None = None
    kernels: int = 0
    cached: int = 0
    error: str = ""
    unchecked: str = ""


@dataclass(frozen=True)
class TritonFacts:
    """Whether Triton is installed, its version, why it does not import or cannot target the GPU
    (``error``), and the GPU target it compiles for."""

    installed: bool = False
    version: str = ""
    error: str = ""
    target: str = ""


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# ---- facts -----------------------------------------------------------------------------------

def horovod_facts() -> HorovodFacts:
    """Horovod's version and build, read from ``horovod`` and ``horovod.torch`` (no ``hvd.init()``)."""
    try:
        import horovod
    except ImportError as e:
        return HorovodFacts(error=_why(e))
    version = getattr(horovod, "__version__", "unknown")
    try:
        import horovod.torch as hvd
    except ImportError as e:
        return HorovodFacts(version, _why(e))
    built = {"Gloo": hvd.gloo_built(), "MPI": hvd.mpi_built(), "NCCL": bool(hvd.nccl_built()), "CUDA": hvd.cuda_built(),
             "ROCm": hvd.rocm_built(), "oneCCL": hvd.ccl_built(), "DDL": hvd.ddl_built()}
    return HorovodFacts(version, built=built)


def torch_facts() -> TorchFacts:
    """torch's version and the names of the CUDA devices it sees."""
    try:
        import torch
    except ImportError as e:
        return TorchFacts(error=_why(e))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return TorchFacts(torch.__version__, cuda=[torch.cuda.get_device_name(i) for i in range(count)])


def numba_facts() -> NumbaFacts:
    """Which of the host path's compiled functions (:mod:`.compressors.segmented`,
    :mod:`.kernels.host`; not the helpers inlined into them) Numba's cache holds for this machine,
    read from its index files without compiling: an entry counts where its key is the one Numba
    would look up here (signature, CPU, bytecode), in an index written by this Numba for the
    current source."""
    try:
        import numba
        from numba.core.caching import FunctionCache
        from numba.core.dispatcher import Dispatcher
        from numba.core.registry import cpu_target
    except ImportError as e:
        return NumbaFacts(error=_why(e))
    try:
        from .compressors import segmented
        from .kernels import host
    except ImportError as e:
        return NumbaFacts(numba.__version__, unchecked=_why(e))
    # a helper compiled into each kernel that calls it (inline="always") has no machine code of its own to cache
    kernels = [f for module in (segmented, host) for f in vars(module).values()
               if isinstance(f, Dispatcher) and f.py_func.__module__ == module.__name__
               and f.targetoptions.get("inline") != "always"]
    try:
        codegen = cpu_target.target_context.codegen()
        cached = 0
        for f in kernels:
            cache = FunctionCache(f.py_func)
            index = cache._cache_file._load_index()  # Numba has no public reader of its cache
            cached += any(key == cache._index_key(key[0], codegen) for key in index)
    except Exception as e:  # noqa: BLE001 - the cache's layout is Numba's: any surprise is a finding
        return NumbaFacts(numba.__version__, len(kernels), error=_why(e))
    return NumbaFacts(numba.__version__, len(kernels), cached)


def triton_facts(cuda_devices: int) -> TritonFacts:
    """Whether Triton is installed (as the kernels look it up), imports, and, with a CUDA device,
    knows the GPU's target."""
    if importlib.util.find_spec("triton") is None:
        return TritonFacts()
    version = importlib.metadata.version("triton")
    try:
        import triton
        target = triton.runtime.driver.active.get_current_target() if cuda_devices else None
    except Exception as e:  # noqa: BLE001 - a broken Triton fails in many ways; each is the finding
        return TritonFacts(True, version, _why(e))
    return TritonFacts(True, version, target=f"{target.backend} {target.arch}" if target else "")


def loading_facts(environ: Mapping[str, str]) -> LoadingFacts:
    """The loading switch in ``environ``, read as the import reads it, and the worker count the
    launcher exported."""
    try:
        from .compressors import loading
    except Exception as e:  # noqa: BLE001 - torch or Numba broken: the other findings say which
        return LoadingFacts(error=_why(e))
    try:
        on = loading.on_import(environ)
    except ValueError:
        on = None
    return LoadingFacts(loading.ON_IMPORT_ENV, environ.get(loading.ON_IMPORT_ENV), on, launcher.workers(environ))


# ---- judgements ------------------------------------------------------------------------------

def judge_horovod(h: HorovodFacts, cuda_devices: int) -> list[Finding]:
    """Horovod's version against :data:`SUPPORTED_HOROVOD` and its PyTorch binding; then its
    controllers (Gloo or MPI, one at least) and, with CUDA devices, NCCL."""
    if h.version is None:
        return [Finding("horovod", FATAL, f"not importable ({h.error})", INSTALL_HOROVOD)]
    if h.error:
        return [Finding("horovod", FATAL, f"{h.version}, but horovod.torch does not import ({h.error}): built "
                        "without PyTorch, or against another torch", INSTALL_HOROVOD)]
    from packaging.specifiers import SpecifierSet  # Horovod requires packaging
    from packaging.version import InvalidVersion, Version
    try:
        supported = Version(h.version) in SpecifierSet(SUPPORTED_HOROVOD, prereleases=True)
    except InvalidVersion:
        supported = False
    if supported:
        out = [Finding("horovod", OK, f"{h.version} with PyTorch (supported: {SUPPORTED_HOROVOD})")]
    else:
        out = [Finding("horovod", WARNING, f"{h.version} with PyTorch, untested (supported: {SUPPORTED_HOROVOD})",
                       f"install a supported Horovod: {INSTALL_HOROVOD}")]
    built = [name for name, yes in h.built.items() if yes]
    absent = [name for name, yes in h.built.items() if not yes]
    found = f"built with {', '.join(built) or 'nothing'}" + (f"; without {', '.join(absent)}" if absent else "")
    if not (h.built.get("Gloo") or h.built.get("MPI")):
        out.append(Finding("horovod build", FATAL, f"{found}: no controller, no job can start",
                           f"rebuild Horovod with HOROVOD_WITH_GLOO=1 (or HOROVOD_WITH_MPI=1): {INSTALL_HOROVOD}"))
    elif cuda_devices and not h.built.get("NCCL"):
        out.append(Finding("horovod build", WARNING, f"{found}: CUDA tensors are reduced without NCCL",
                           "rebuild Horovod with HOROVOD_GPU_OPERATIONS=NCCL for GPU jobs"))
    else:
        out.append(Finding("horovod build", OK, found))
    return out


def judge_torch(t: TorchFacts) -> Finding:
    """torch is needed; its devices are reported."""
    if t.version is None:
        return Finding("torch", FATAL, f"not importable ({t.error})",
                       "pip install torch, then build Horovod against it (make install)")
    devices = f"{len(t.cuda)} CUDA device(s): {', '.join(t.cuda)}" if t.cuda else "CPU only (no CUDA device)"
    return Finding("torch", OK, f"{t.version}; {devices}")


def judge_numba(n: NumbaFacts) -> Finding:
    """Numba is needed (the host path's kernels); kernels missing from its cache cost the first
    step their compilation."""
    if n.version is None:
        return Finding("numba", FATAL, f"not importable ({n.error})",
                       "pip install numba: it compiles the CPU selection kernels")
    if n.unchecked:
        return Finding("numba", WARNING, f"{n.version}; kernels not checked: their modules do not import "
                       f"({n.unchecked})", "run the doctor again once horovod_safusion imports")
    if n.error:
        return Finding("numba", WARNING, f"{n.version}; its kernel cache could not be read ({n.error})",
                       f"if the first step is slow, compile the kernels ahead: {WARM_UP}")
    if n.cached < n.kernels:
        return Finding("numba", WARNING, f"{n.version}; {n.kernels - n.cached} of {n.kernels} CPU kernels not "
                       "cached: the first step compiles them (tens of seconds on a small CPU)",
                       f"compile them once, as the install does: {WARM_UP}")
    return Finding("numba", OK, f"{n.version}; all {n.kernels} CPU kernels compiled and cached")


def judge_triton(t: TritonFacts, cuda_devices: int) -> Finding:
    """Triton runs the kernels of CUDA tensors where it is installed (PyTorch's otherwise); on a
    machine without CUDA it is unused."""
    if not t.installed:
        if cuda_devices:
            return Finding("triton", WARNING, "not installed: CUDA tensors take the PyTorch kernels (more passes "
                           "over each buffer)", "pip install 'horovod-safusion[gpu]' (or pip install triton)")
        return Finding("triton", OK, "not installed (used only for CUDA tensors)")
    if t.error:
        if cuda_devices:
            return Finding("triton", FATAL, f"{t.version} installed but unusable ({t.error}): the first selection "
                           "of a CUDA tensor fails", "reinstall Triton for this torch (pip install --force-reinstall "
                           "triton), or uninstall it and CUDA tensors take the PyTorch kernels")
        return Finding("triton", WARNING, f"{t.version} installed but does not import ({t.error}); unused on CPU",
                       "reinstall Triton before a GPU job, or uninstall it")
    if cuda_devices:
        return Finding("triton", OK, f"{t.version}, used for CUDA tensors ({t.target})")
    return Finding("triton", OK, f"{t.version}, installed, unused on CPU (used only for CUDA tensors)")


def judge_cycle(environ: Mapping[str, str], set_on_import: bool | None) -> Finding:
    """Who chose Horovod's cycle time (:mod:`.cycle`): the package on import, the user, Horovod's
    autotuner, or nobody (Horovod's default)."""
    value = environ.get(cycle.ENV)
    workers, cpus = launcher.local_workers(environ), os.cpu_count()
    if set_on_import:
        return Finding("cycle time", OK, f"{value} ms, set by horovod_safusion on import ({workers} workers on "
                       f"this host share {cpus} logical CPUs; {cycle.ENV} chooses another)")
    if value is not None:
        return Finding("cycle time", OK, f"{value} ms, set by you ({cycle.ENV}={value})")
    if cycle.autotune(environ):
        return Finding("cycle time", OK, f"tuned by Horovod's autotuner (HOROVOD_AUTOTUNE="
                       f"{environ['HOROVOD_AUTOTUNE']})")
    if set_on_import is None:
        why = "horovod_safusion did not import"
    elif cycle.shares_cores(environ):
        why = "Horovod was initialised first"
    else:
        why = f"{workers} worker{'s' if workers > 1 else ''} on this host, {cpus} logical CPUs: none shared"
    return Finding("cycle time", OK, f"Horovod's default, 1 ms ({why})")


def judge_loading(f: LoadingFacts) -> Finding:
    """Whether ``import horovod_safusion`` loads the float32 selection kernels here
    (:func:`~horovod_safusion.compressors.loading.load_on_import`): a value of its switch other
    than 0 and 1 makes the import fail."""
    check = "kernels at import"
    if f.error:
        return Finding(check, OK, f"not read: the kernels' loader does not import ({f.error})")
    if f.on is None:
        return Finding(check, FATAL, f"{f.env}={f.value!r}: neither 0 nor 1, so import horovod_safusion fails",
                       f"set {f.env} to 0 (a job forced dense: no kernels held) or 1, or unset it")
    if not f.on:
        return Finding(check, OK, f"not loaded ({f.env}=0): a sparse optimizer loads them")
    if f.workers > 1:
        return Finding(check, OK, f"loaded by import horovod_safusion (a worker of a job of {f.workers}; "
                       f"{f.env}=0 leaves them to a sparse optimizer)")
    return Finding(check, OK, "not loaded: not a worker of a launched job of several (a sparse optimizer "
                   "loads them)")


def judge_import(error: BaseException, others: Sequence[Finding]) -> Finding:
    """``import horovod_safusion`` failed: fatal, fixed by the other fatal findings if any names why."""
    advice = ("fix the fatal findings above" if any(f.level == FATAL for f in others) else
              "reinstall horovod-safusion (make install, or pip install -e . in its clone)")
    return Finding("horovod_safusion", FATAL, f"does not import ({_why(error)})", advice)


# ---- report ----------------------------------------------------------------------------------

def findings(import_error: BaseException | None = None) -> list[Finding]:
    """Every check's findings in this process and environment; with ``import_error`` (the package's
    own import failed), a fatal finding for it last."""
    torch = torch_facts()
    found = [*judge_horovod(horovod_facts(), len(torch.cuda)), judge_torch(torch), judge_numba(numba_facts()),
             judge_triton(triton_facts(len(torch.cuda)), len(torch.cuda)), judge_cycle(os.environ, cycle.set_on_import),
             judge_loading(loading_facts(os.environ))]
    if import_error is not None:
        found.append(judge_import(import_error, found))
    return found


def render(found: Sequence[Finding]) -> str:
    """One aligned line per finding, its advice indented under it, and a summary line."""
    width = max(len(f.check) for f in found)
    lines = []
    for f in found:
        lines.append(f"{f.level:<7}  {f.check:<{width}}  {f.found}")
        if f.advice:
            lines.append(f"{'':<{9 + width + 2}}-> {f.advice}")
    counts = {level: sum(f.level == level for f in found) for level in (OK, WARNING, FATAL)}
    verdict = "the plugin cannot run here" if counts[FATAL] else "the plugin can run here"
    lines.append(f"{counts[OK]} ok, {counts[WARNING]} warning(s), {counts[FATAL]} fatal: {verdict}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``doctor`` command's options."""
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


def run(as_json: bool = False, import_error: BaseException | None = None) -> int:
    """Print the report (or JSON); 1 if any finding is fatal, 0 otherwise."""
    found = findings(import_error)
    fatal = any(f.level == FATAL for f in found)
    print(json.dumps({"fatal": fatal, "findings": [asdict(f) for f in found]}, indent=1) if as_json else render(found))
    return 1 if fatal else 0


def fallback(error: Exception) -> None:
    """Called by the package's ``__init__`` when its imports fail, or its loading switch is neither
    0 nor 1 (:func:`judge_loading`). Under ``python -m horovod_safusion doctor`` (while Python
    locates the module, ``sys.argv[0]`` is ``-m``) or the ``horovod-safusion doctor`` script, print
    the report and exit, since the command line's module cannot run without the package; otherwise
    return, and the caller raises ``error``."""
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    if program in ("-m", "horovod-safusion") and sys.argv[1:2] == ["doctor"]:
        parser = argparse.ArgumentParser(prog=f"{'python -m horovod_safusion' if program == '-m' else program} doctor")
        add_arguments(parser)
        sys.exit(run(parser.parse_args(sys.argv[2:]).json, error))
