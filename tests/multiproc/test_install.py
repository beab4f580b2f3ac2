"""The package as a user gets it from ``pip install .``: not editable, and without the repository on
the path.

A fresh virtual environment is made in a temporary directory on top of the project's own (this
Python's): a ``.pth`` file lists that environment's site-packages, so torch and the built Horovod
are found there and nothing is downloaded or rebuilt. Python adds a directory listed in a ``.pth``
file to ``sys.path`` without reading the ``.pth`` files inside it, so the editable install of the
project's environment (a ``__editable__*.pth`` finder) does not reach the new environment. The
package is installed from a copy of the repository (so the build writes nothing into the working
tree), and a two-worker ``horovodrun`` job runs from the temporary directory with the new
environment's Python.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys

import pytest

from launch import horovodrun, run as run_horovodrun

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAUNCH_TIMEOUT = 300  # the job takes well under a minute; longer means a hang
STEP_TIMEOUT = 300  # one venv or pip command

pytestmark = pytest.mark.multiproc


def _ignore(top: str):
    """What a fresh clone would not have: build outputs, caches, virtual environments, .git."""
    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in ("__pycache__", ".git", ".pytest_cache", ".hypothesis")
                or n.endswith(".egg-info") or os.path.exists(os.path.join(directory, n, "pyvenv.cfg"))}
        if os.path.samefile(directory, top):
            skip |= {n for n in names if n in ("build", "out", "dist")}
        return skip
    return ignore


def _project_site_dirs() -> list[str]:
    """This Python's site-packages directories, in ``sys.path`` order."""
    dirs = {os.path.realpath(d) for d in site.getsitepackages() if os.path.isdir(d)}
    ordered = []
    for p in sys.path:
        if p and os.path.realpath(p) in dirs and os.path.realpath(p) not in ordered:
            ordered.append(os.path.realpath(p))
    return ordered


def _check(cmd: list[str], env: dict, cwd: str) -> str:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=STEP_TIMEOUT)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh environment with the package installed by ``pip install --no-deps .``: a dict with
    its ``python``, its ``purelib``, the ``env`` to run it with and a ``work`` directory outside the
    repository."""
    tmp = tmp_path_factory.mktemp("install")
    src, venv, work = tmp / "src", tmp / "env", tmp / "work"
    shutil.copytree(ROOT, src, ignore=_ignore(ROOT))
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), os.path.dirname(sys.executable), env.get("PATH", "")])
    _check([sys.executable, "-m", "venv", "--without-pip", str(venv)], env, str(work))
    python = str(venv / "bin" / "python")
    purelib = _check([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env,
                     str(work)).strip()
    with open(os.path.join(purelib, "_project_environment.pth"), "w") as f:
        f.write("".join(d + "\n" for d in _project_site_dirs()))
    # pip (and setuptools, for --no-build-isolation) come from the project's environment
    _check([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
            "--no-build-isolation", str(src)], env, str(work))
    return {"python": python, "purelib": os.path.realpath(purelib), "env": env, "work": str(work), "src": str(src)}


PROBE = """
import json, sys
import horovod_safusion, horovod
from importlib import metadata
from horovod_safusion.requirements import SUPPORTED_HOROVOD
dist = metadata.distribution("horovod-safusion")
print(json.dumps({"file": horovod_safusion.__file__, "sys_path": sys.path, "horovod": horovod.__version__,
                  "finders": [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path],
                  "supported": SUPPORTED_HOROVOD, "requires": dist.requires,
                  "extras": dist.metadata.get_all("Provides-Extra"),
                  "dist_files": [str(f) for f in dist.files], "dist_path": str(dist.locate_file(""))}))
"""


def _probe(installed) -> dict:
    return json.loads(_check([installed["python"], "-c", PROBE], installed["env"], installed["work"]))


def test_installed_copy_is_imported_and_complete(installed):
    """The new environment imports the installed copy (not the repository, not the editable
    install), which has every module of the repository's package, and its metadata asks for the
    Horovod range the package names (:data:`horovod_safusion.requirements.SUPPORTED_HOROVOD`)."""
    from packaging.requirements import Requirement

    probe = _probe(installed)
    purelib = installed["purelib"]
    assert os.path.realpath(probe["file"]) == os.path.join(purelib, "horovod_safusion", "__init__.py"), probe["file"]
    assert os.path.realpath(probe["dist_path"]) == purelib
    paths = [os.path.realpath(p) for p in probe["sys_path"] if p]
    assert os.path.realpath(ROOT) not in paths
    # no .pth file of the project's environment ran (its editable install adds an _EditableFinder)
    assert not [f for f in probe["finders"] if "editable" in f.lower()], probe["finders"]
    project = _project_site_dirs()
    assert paths.index(purelib) < min(paths.index(d) for d in project), paths  # its own site-packages first

    src_pkg = os.path.join(installed["src"], "horovod_safusion")
    shipped = {os.path.relpath(os.path.join(d, n), src_pkg) for d, _, ns in os.walk(src_pkg) for n in ns
               if n.endswith(".py")}
    installed_py = {os.path.relpath(f, "horovod_safusion") for f in probe["dist_files"]
                    if f.startswith("horovod_safusion/") and f.endswith(".py")}
    assert shipped - installed_py == set(), "modules missing from the installed package (find_packages?)"

    reqs = {Requirement(r).name: Requirement(r) for r in probe["requires"]}
    assert str(reqs["horovod"].specifier) == str(Requirement("horovod" + probe["supported"]).specifier)
    assert reqs["horovod"].specifier.contains(probe["horovod"]), "the environment's Horovod is outside the range"
    assert "gpu" in probe["extras"] and any(r.name == "triton" and r.marker for r in reqs.values())


def test_pip_install_with_extras_keeps_the_environment(installed):
    """``pip install ".[gpu]"`` with the index switched off: every requirement, Horovod's range
    included, is met by the environment as it is (nothing to build or download)."""
    out = _check([installed["python"], "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
                  "--no-build-isolation", installed["src"] + "[gpu]"], installed["env"], installed["work"])
    assert "Requirement already satisfied: horovod" in out and "Requirement already satisfied: triton" in out, out
    assert "Collecting horovod" not in out and "Building wheel for horovod " not in out, out
    assert _probe(installed)["file"].startswith(installed["purelib"])


def test_two_workers_train_with_the_installed_package(installed, tmp_path):
    """``horovodrun -np 2 --gloo`` from outside the repository: both ranks import the installed
    copy, train, end with identical replicas and a lower loss."""
    worker = os.path.join(installed["work"], "install_worker.py")
    shutil.copy(os.path.join(HERE, "install_worker.py"), worker)
    out = tmp_path / "records"
    out.mkdir()
    cmd = [horovodrun(), "-np", "2", "-H", "localhost:2", "--gloo", installed["python"], worker, str(out)]
    proc = run_horovodrun(cmd, LAUNCH_TIMEOUT, env=installed["env"], cwd=installed["work"])
    records = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else {}
               for r in range(2)]
    assert proc.returncode == 0, f"horovodrun exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    for r, rec in enumerate(records):
        assert rec.get("rank") == r and rec["size"] == 2, rec
        assert "exception" not in rec, rec["exception"]
        assert os.path.realpath(rec["file"]).startswith(installed["purelib"] + os.sep), rec["file"]
        assert os.path.realpath(rec["cwd"]) == os.path.realpath(installed["work"])
        assert rec["loss_after"] < 0.9 * rec["loss_before"], rec
    assert records[0]["checksums"][0] == records[0]["checksums"][1], "replicas differ"
    assert records[0]["checksums"] == records[1]["checksums"]
