"""``python -m horovod_safusion doctor``: the report of this environment, who chose the cycle time,
whether the kernels load at import, a fatal finding when Horovod does not import or the loading's
switch is neither 0 nor 1 (a report, not a traceback), and how findings are judged from facts made
up for each case."""
import json
import os
import re
import subprocess
import sys
from unittest import mock

import horovod
import pytest
import torch
from hypothesis import given, strategies as st

from horovod_safusion import cycle, doctor, launcher
from horovod_safusion.__main__ import main
from horovod_safusion.doctor import (FATAL, OK, WARNING, Finding, HorovodFacts, LoadingFacts, NumbaFacts, TorchFacts,
                                     TritonFacts, judge_cycle, judge_horovod, judge_loading, judge_numba, judge_torch,
                                     judge_triton)


SWITCH = "HOROVOD_SAFUSION_LOAD_ON_IMPORT"  # the kernels' loading at import


def run_doctor(*args: str, pythonpath: str = "", **env: str) -> subprocess.CompletedProcess:
    """``python -m horovod_safusion doctor ARGS`` in a fresh interpreter, with no cycle time or
    autotuner chosen unless ``env`` chooses one, and ``pythonpath`` first on the path."""
    environ = {k: v for k, v in os.environ.items() if k not in (cycle.ENV, "HOROVOD_AUTOTUNE", *launcher.LOCAL_SIZE)}
    if pythonpath:
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "horovod_safusion", "doctor", *args], env={**environ, **env},
                          capture_output=True, text=True, timeout=120)


def line(out: str, check: str) -> str:
    """The report's line for ``check``: level, the check's name, what was found."""
    found = [ln for ln in out.splitlines() if re.match(rf"(ok|warning|fatal)\s+{re.escape(check)}  ", ln)]
    assert len(found) == 1, out
    return found[0]


def test_doctor_reports_this_environment():
    run = run_doctor()
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert horovod.__version__ in line(out, "horovod")
    assert re.search(r"built with .*\b(Gloo|MPI)\b", line(out, "horovod build"))
    assert f"{torch.__version__}; " in line(out, "torch")
    assert re.search(r"CPU kernels (compiled and cached|not cached)", line(out, "numba"))
    assert "triton" in out
    # a process launched on its own is one worker, with a CPU of its own
    assert "Horovod's default, 1 ms (1 worker on this host" in line(out, "cycle time")
    assert re.search(r"^\d+ ok, \d+ warning\(s\), 0 fatal: the plugin can run here$", out, re.MULTILINE)


def test_the_readme_shows_what_doctor_reports():
    """The README shows a doctor report: the same checks, in the same order, as doctor makes now."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8").read()
    shown = readme.split("$ python -m horovod_safusion doctor\n", 1)[1].split("```", 1)[0]
    names = re.compile(r"^(?:ok|warning|fatal)\s+(\S.*?)\s{2,}", re.MULTILINE)
    assert names.findall(run_doctor().stdout) == names.findall(shown) != []


def test_the_cycle_time_set_where_the_hosts_workers_share_its_cpus():
    crowded = str((os.cpu_count() or 1) + 1)
    run = run_doctor(HOROVOD_LOCAL_SIZE=crowded)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (f"{cycle.CYCLE_TIME_MS:g} ms, set by horovod_safusion on import ({crowded} workers on this host share "
            f"{os.cpu_count()} logical CPUs") in line(run.stdout, "cycle time")


def test_the_cycle_time_you_chose_is_yours():
    run = run_doctor(HOROVOD_CYCLE_TIME="3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 ms, set by you (HOROVOD_CYCLE_TIME=3)" in line(run.stdout, "cycle time")


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("off", None)])
def test_the_doctor_reads_the_switch_as_the_import_does(value, on):
    environ = {"HOROVOD_SIZE": "4"} if value is None else {"HOROVOD_SIZE": "4", SWITCH: value}
    assert doctor.loading_facts(environ) == LoadingFacts(SWITCH, value, on, 4)


def test_a_loading_switch_that_is_neither_0_nor_1_is_fatal_and_reported():
    """The package's import raises on it before ``__main__`` runs; the doctor still reports, says
    what to set, and exits 1."""
    run = run_doctor(HOROVOD_SAFUSION_LOAD_ON_IMPORT="yes")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "HOROVOD_SAFUSION_LOAD_ON_IMPORT='yes': neither 0 nor 1" in line(run.stdout, "kernels at import")
    assert "must be one of '0', '1'; got 'yes'" in line(run.stdout, "horovod_safusion")
    assert "Traceback" not in run.stderr


def test_the_kernels_the_install_compiled_are_all_reported_cached():
    """Every compiled kernel of the host path has machine code in Numba's cache once the install's
    warm-up ran (here, again: it loads what is cached); a helper inlined into the kernels that call
    it has none of its own, and is not counted as missing."""
    from horovod_safusion.compressors import segmented
    from horovod_safusion.kernels import host
    segmented.warm_up()
    host.warm_up()
    facts = doctor.numba_facts()
    assert segmented._radix.targetoptions["inline"] == "always"
    assert facts.kernels > 0 and facts.cached == facts.kernels, facts


def test_a_horovod_that_does_not_import_is_fatal_and_reported(tmp_path):
    """A broken install, simulated by a ``horovod`` package that raises on import: the package's own
    import fails before ``__main__`` runs, and the doctor still reports (here as JSON) and exits 1."""
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text('raise ImportError("simulated broken Horovod")\n')
    run = run_doctor("--json", pythonpath=str(tmp_path))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    report = json.loads(run.stdout)
    levels = {f["check"]: f["level"] for f in report["findings"]}
    assert report["fatal"] and levels["horovod"] == FATAL and levels["horovod_safusion"] == FATAL
    assert "simulated broken Horovod" in next(f["found"] for f in report["findings"] if f["check"] == "horovod")
    assert "did not import" in next(f["found"] for f in report["findings"] if f["check"] == "cycle time")


def test_the_cli_prints_json(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not report["fatal"]
    assert [f["check"] for f in report["findings"]] == ["horovod", "horovod build", "torch", "numba", "triton",
                                                         "cycle time", "kernels at import"]


BUILT = {"Gloo": True, "MPI": True, "NCCL": False}


@pytest.mark.parametrize("facts, cuda, levels", [
    (HorovodFacts(error="ModuleNotFoundError: No module named 'horovod'"), 0, [FATAL]),
    (HorovodFacts("0.28.1", "ImportError: Extension horovod.torch has not been built"), 0, [FATAL]),
    (HorovodFacts("0.28.1", built=BUILT), 0, [OK, OK]),
    (HorovodFacts("0.28.2", built=BUILT), 0, [OK, OK]),
    (HorovodFacts("0.27.2", built=BUILT), 0, [WARNING, OK]),
    (HorovodFacts("0.29.0", built=BUILT), 0, [WARNING, OK]),
    (HorovodFacts("unknown", built=BUILT), 0, [WARNING, OK]),
    (HorovodFacts("0.28.1", built={"Gloo": True, "MPI": False}), 0, [OK, OK]),
    (HorovodFacts("0.28.1", built={"Gloo": False, "MPI": True}), 0, [OK, OK]),
    (HorovodFacts("0.28.1", built={"Gloo": False, "MPI": False, "NCCL": True}), 0, [OK, FATAL]),
    (HorovodFacts("0.28.1", built=BUILT), 1, [OK, WARNING]),
    (HorovodFacts("0.28.1", built={**BUILT, "NCCL": True}), 1, [OK, OK]),
], ids=["missing", "no PyTorch binding", "supported", "a later 0.28", "older", "newer", "no version", "Gloo only",
        "MPI only", "no controller", "GPU without NCCL", "GPU with NCCL"])
def test_horovod_findings(monkeypatch, facts, cuda, levels):
    monkeypatch.setattr(doctor, "SUPPORTED_HOROVOD", ">=0.28.1,<0.29")
    found = judge_horovod(facts, cuda)
    assert [f.level for f in found] == levels
    assert all(f.advice for f in found if f.level != OK)


@pytest.mark.parametrize("finding, level, says", [
    (judge_torch(TorchFacts(error="ModuleNotFoundError: No module named 'torch'")), FATAL, "not importable"),
    (judge_torch(TorchFacts("2.13.0+cpu")), OK, "CPU only"),
    (judge_torch(TorchFacts("2.13.0", cuda=("NVIDIA H100", "NVIDIA H100"))), OK, "2 CUDA device(s): NVIDIA H100"),
    (judge_numba(NumbaFacts(error="ModuleNotFoundError: No module named 'numba'")), FATAL, "not importable"),
    (judge_numba(NumbaFacts("0.68.1", unchecked="ImportError: horovod")), WARNING, "not checked"),
    (judge_numba(NumbaFacts("0.68.1", 19, error="AttributeError: _cache_file")), WARNING, "could not be read"),
    (judge_numba(NumbaFacts("0.68.1", 19, 0)), WARNING, "19 of 19 CPU kernels not cached"),
    (judge_numba(NumbaFacts("0.68.1", 19, 18)), WARNING, "1 of 19"),
    (judge_numba(NumbaFacts("0.68.1", 19, 19)), OK, "all 19 CPU kernels compiled and cached"),
    (judge_triton(TritonFacts(), 0), OK, "not installed"),
    (judge_triton(TritonFacts(), 1), WARNING, "PyTorch kernels"),
    (judge_triton(TritonFacts(True, "3.6.0"), 0), OK, "unused on CPU"),
    (judge_triton(TritonFacts(True, "3.6.0", target="cuda 90"), 1), OK, "used for CUDA tensors (cuda 90)"),
    (judge_triton(TritonFacts(True, "3.6.0", "ImportError: libcuda"), 0), WARNING, "does not import"),
    (judge_triton(TritonFacts(True, "3.6.0", "RuntimeError: no driver"), 1), FATAL, "fails"),
], ids=["no torch", "torch on CPU", "torch with GPUs", "no numba", "kernels unchecked", "cache unreadable",
        "nothing cached", "one not cached", "all cached", "no triton, CPU", "no triton, GPU", "triton, CPU",
        "triton, GPU", "broken triton, CPU", "broken triton, GPU"])
def test_findings_from_facts(finding, level, says):
    assert finding.level == level and says in finding.found
    assert bool(finding.advice) == (level != OK)


@pytest.mark.parametrize("facts, level, says", [
    (LoadingFacts(SWITCH, None, True, 1), OK, "not loaded: not a worker of a launched job"),
    (LoadingFacts(SWITCH, None, True, 8), OK, "loaded by import horovod_safusion (a worker of a job of 8"),
    (LoadingFacts(SWITCH, "1", True, 2), OK, "loaded by import horovod_safusion"),
    (LoadingFacts(SWITCH, "0", False, 8), OK, "not loaded (HOROVOD_SAFUSION_LOAD_ON_IMPORT=0)"),
    (LoadingFacts(SWITCH, "true", None, 8), FATAL, "'true': neither 0 nor 1"),
    (LoadingFacts(error="ModuleNotFoundError: No module named 'numba'"), OK, "not read"),
], ids=["one worker", "a worker of 8", "on", "off", "neither", "loader broken"])
def test_whether_the_kernels_load_at_import(facts, level, says):
    finding = judge_loading(facts)
    assert finding.level == level and says in finding.found
    assert bool(finding.advice) == (level != OK)


CROWDED = {"HOROVOD_LOCAL_SIZE": str((os.cpu_count() or 1) + 1)}  # one worker more than the host's CPUs


@pytest.mark.parametrize("environ, set_on_import, says", [
    ({cycle.ENV: "5"}, True, "5 ms, set by horovod_safusion on import"),
    ({cycle.ENV: "3"}, False, "3 ms, set by you (HOROVOD_CYCLE_TIME=3)"),
    ({cycle.ENV: "3", "HOROVOD_AUTOTUNE": "1"}, False, "set by you"),  # Horovod keeps a chosen cycle time fixed
    ({"HOROVOD_AUTOTUNE": "1"}, False, "Horovod's autotuner (HOROVOD_AUTOTUNE=1)"),
    ({"HOROVOD_AUTOTUNE": "0", **CROWDED}, False, "Horovod was initialised first"),
    ({"HOROVOD_LOCAL_SIZE": "1"}, False, "1 worker on this host"),
    ({}, None, "horovod_safusion did not import"),
], ids=["package", "user", "user and autotuner", "autotuner", "initialised first", "a CPU each", "package broken"])
def test_who_chose_the_cycle_time(environ, set_on_import, says):
    finding = judge_cycle(environ, set_on_import)
    assert finding.level == OK and says in finding.found


@given(st.lists(st.tuples(st.sampled_from([OK, WARNING, FATAL]), st.text("abc ", min_size=1, max_size=12)),
                min_size=1, max_size=8))
def test_the_report_aligns_advice_and_exits_non_zero_on_a_fatal_finding(levels_and_texts):
    found = [Finding(f"check{i}", level, text, "" if level == OK else "do this")
             for i, (level, text) in enumerate(levels_and_texts)]
    report = doctor.render(found).splitlines()
    assert len(report) == len(found) + sum(f.level != OK for f in found) + 1
    for f in found:  # each advice line is indented under its finding's text
        at = next(i for i, ln in enumerate(report) if ln.startswith(f"{f.level:<7}  {f.check} "))
        if f.advice:
            assert report[at + 1].strip() == "-> do this"
            assert report[at + 1].index("->") == len(report[at]) - len(f.found)
    fatal = any(f.level == FATAL for f in found)
    assert report[-1].endswith("cannot run here" if fatal else "can run here")
    with mock.patch.object(doctor, "findings", lambda import_error=None: found):
        assert doctor.run() == int(fatal)
