"""Timeline: recording in a real one-worker Horovod job, robust reading, merging, the breakdown.

The two-worker run under ``horovodrun --timeline-filename`` is in ``tests/multiproc/test_timeline_merge.py``.
"""
import functools
import json
import time

import pytest
import torch
import torch.nn.functional as F

import horovod_safusion as saf
from horovod_safusion.__main__ import main
from horovod_safusion.clock import epoch_offset
from horovod_safusion.fusion import NaivePlanner
from horovod_safusion.timeline import TimelineRecorder, TraceError, load_events
from horovod_safusion.timeline.breakdown import PARTS, breakdown
from horovod_safusion.timeline.merge import merge
from horovod_safusion.timeline.recorder import ENV, rank_path
from horovod_safusion.timeline.trace import nesting_violations, start_micros

from digits import DigitsCNN, load_digits_split

STEPS = 8
data = functools.lru_cache(maxsize=1)(load_digits_split)


def train(tmp_path, timeline, steps=STEPS, model=None, **kw):
    """A real training run of the digits CNN; returns the optimizer and the wall seconds per step."""
    x, y, _, _ = data()
    torch.manual_seed(0)
    model = model or DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), min_selected=0, density=0.05, timeline=timeline,
                                   fusion=NaivePlanner(capacity_bytes=4096), **kw)
    walls = []
    for s in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x[32 * s:32 * s + 32]), y[32 * s:32 * s + 32]).backward()
        opt.step()
        walls.append(time.perf_counter() - t0)
    return opt, walls


def test_off_by_default_and_on_by_environment_variable(hvd, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    opt, _ = train(tmp_path, None, steps=1)
    assert opt.timeline is None and opt.controller.observer is None

    monkeypatch.setenv(ENV, str(tmp_path / "env.json"))
    opt, _ = train(tmp_path, None, steps=3)
    opt.timeline.close()
    assert opt.timeline.path == str(tmp_path / "env.rank0.json")
    assert {e["name"] for e in load_events(opt.timeline.path)} >= {"ITERATION", "COMPRESS", "COLLECTIVE"}


def test_bad_timeline_argument_is_a_clear_error(hvd, tmp_path):
    with pytest.raises(ValueError, match=r"timeline must be None, a file path .* got 3"):
        train(tmp_path, 3, steps=0)


def test_rank_path():
    assert rank_path("out/saf.json", 3) == "out/saf.rank3.json"
    assert rank_path("out/t-{rank}.trace", 1) == "out/t-1.trace"
    assert rank_path("saf", 0) == "saf.rank0.json"


def test_recorded_events_are_a_valid_chrome_trace_that_nests(hvd, tmp_path):
    opt, _ = train(tmp_path, str(tmp_path / "saf.json"))
    opt.timeline.close()
    text = (tmp_path / "saf.rank0.json").read_text()
    events = json.loads(text)  # closed: plain JSON
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert names == {"ITERATION", "FORWARD", "BACKWARD", "GRADIENT_READY", "MEMCPY_IN_FUSION_BUFFER", "COMPRESS",
                     "SUBMIT", "SYNCHRONIZE", "WAIT_FOR_COLLECTIVE", "DECOMPRESS", "MEMCPY_OUT_FUSION_BUFFER",
                     "OPTIMIZER_STEP", "COLLECTIVE"}
    for e in events:
        assert e["ph"] in "XM" and isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["tid"], int)
    assert nesting_violations(events) == []
    tensors = sum(map(len, opt.plan.buffers))
    # one GRADIENT_READY per tensor and step; one COLLECTIVE per buffer and step
    assert sum(e["name"] == "GRADIENT_READY" for e in events) == tensors * STEPS
    assert sum(e["name"] == "COLLECTIVE" for e in events) == len(opt.plan.buffers) * STEPS
    assert sum(e["name"] == "ITERATION" for e in events) == STEPS - 1  # the first has no start


def test_nesting_check_reports_partial_overlap():
    ok = [{"ph": "X", "name": "a", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
          {"ph": "X", "name": "b", "ts": 2, "dur": 3, "pid": 1, "tid": 1},
          {"ph": "X", "name": "c", "ts": 5, "dur": 10, "pid": 1, "tid": 2}]  # other row: may overlap
    assert nesting_violations(ok) == []
    bad = ok + [{"ph": "X", "name": "d", "ts": 8, "dur": 5, "pid": 1, "tid": 1}]
    (msg,) = nesting_violations(bad)
    assert "d [8.0, 13.0] overlaps a [0.0, 10.0]" in msg


def test_parts_add_up_to_the_iteration_and_to_the_wall_clock(hvd, tmp_path):
    """Stated tolerance: the unattributed rest is under 10 % of the iteration, and the recorded
    iteration is within 10 % (or 1 ms) of the wall time measured around each step by the caller."""
    opt, walls = train(tmp_path, str(tmp_path / "saf.json"), steps=12)
    opt.timeline.close()
    b = breakdown(opt.timeline.path, skip=2)
    assert b.iterations == 12 - 1 - 2 and b.ranks == 1
    assert set(b.parts) == set(PARTS)
    assert all(v >= 0 for k, v in b.parts.items() if k != "other"), b.parts
    assert abs(b.parts["other"]) < 0.10 * b.iteration, b.parts
    wall = sum(walls[3:]) / len(walls[3:])  # the recorded iterations 3..11 start where step 2 ended
    assert abs(b.iteration - wall) < max(0.10 * wall, 1e-3), (b.iteration, wall)
    assert 0 < b.collective <= b.iteration and b.buffers == len(opt.plan.buffers)


def test_watched_model_gives_exact_forward_spans(hvd, tmp_path):
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    rec = TimelineRecorder(str(tmp_path / "w.json"), model=model)
    opt, _ = train(tmp_path, rec, steps=4, model=model)
    rec.close()
    events = load_events(rec.path)
    fwd = [e for e in events if e.get("name") == "FORWARD"]
    its = [e for e in events if e.get("name") == "ITERATION"]
    assert len(fwd) == len(its) == 3
    for f, it in zip(fwd, its):  # inside its iteration, not starting at it (zero_grad comes first)
        assert it["ts"] < f["ts"] and f["ts"] + f["dur"] <= it["ts"] + it["dur"]
    assert nesting_violations(events) == []


HOROVOD_STYLE = ('[\n{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros":%d}},\n'
                 '{"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},\n'
                 '{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allgather.saf.ag.0"}},\n'
                 '{"name": "process_sort_index", "ph": "M", "pid": 1, "args": {"sort_index": 1}},\n'
                 '{"ph": "B", "name": "ALLGATHER", "ts": 100, "pid": 1},{"ph": "E", "ts": 250, "pid": 1}')


@pytest.mark.parametrize("ending", ["]", "", ",", ',{"ph": "B", "na'])
def test_unclosed_horovod_file_is_read_and_merged(hvd, tmp_path, ending):
    opt, _ = train(tmp_path, str(tmp_path / "saf.json"), steps=3)
    opt.timeline.close()
    plugin_start = start_micros(load_events(opt.timeline.path))
    hvd_file = tmp_path / "hvd.json"
    hvd_start = int(plugin_start) - 5000  # Horovod started 5 ms before the plugin
    hvd_file.write_text(HOROVOD_STYLE % hvd_start + ending)
    assert [e["ph"] for e in load_events(str(hvd_file))] == ["M"] * 4 + ["B", "E"]

    out = tmp_path / "merged.json"
    assert main(["timeline", "merge", str(opt.timeline.path), str(hvd_file), "-o", str(out)]) == 0
    merged = json.loads(out.read_text())["traceEvents"]
    assert start_micros(merged) == hvd_start
    plugin = [e for e in load_events(opt.timeline.path) if e["ph"] == "X"]
    shifted = [e for e in merged if e["ph"] == "X" and e["pid"] >= 1_000_000]
    assert [e["ts"] for e in shifted] == pytest.approx([e["ts"] + (plugin_start - hvd_start) for e in plugin], abs=1e-3)
    assert any(e.get("name") == "ALLGATHER" for e in merged)


def test_plugin_file_read_while_training_runs(hvd, tmp_path):
    rec = TimelineRecorder(str(tmp_path / "live.json"), flush_every=1)
    opt, _ = train(tmp_path, rec, steps=3)
    live = load_events(rec.path)  # not closed yet: no final ']'
    assert not (tmp_path / "live.rank0.json").read_text().rstrip().endswith("]")
    assert sum(e.get("name") == "ITERATION" for e in live) == 2
    rec.close()


@pytest.mark.parametrize("content, message", [
    ("", "the file is empty"),
    ("hello", "not JSON"),
    ('{"a": 1}', "expected a JSON array of events or an object with a 'traceEvents' array"),
    ('[1, 2]', "every event is an object whose 'ph' is one of"),
    ('[{"ph": "X", "name": "a", "ts": 1', "cannot be repaired"),
])
def test_not_a_chrome_trace_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(TraceError, match=message) as e:
        load_events(str(path))
    assert str(path) in str(e.value) and "is not a Chrome trace" in str(e.value)


def test_cli_names_bad_files(tmp_path, capsys):
    no_start = tmp_path / "plain.json"
    no_start.write_text('[{"ph": "X", "name": "a", "ts": 1, "dur": 1, "pid": 1, "tid": 1}]')
    assert main(["timeline", "merge", str(no_start), "-o", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert str(no_start) in err and "horovodrun --timeline-filename" in err
    assert main(["timeline", "breakdown", str(no_start)]) == 2
    assert "no horovod_safusion events" in capsys.readouterr().err
    assert main(["timeline", "breakdown", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least one file"):
        merge([])
    horovod_only = tmp_path / "hvd.json"
    horovod_only.write_text(HOROVOD_STYLE % 0)
    with pytest.raises(ValueError, match="no horovod_safusion timeline among"):
        merge([str(horovod_only)])


def test_breakdown_cli_table_and_png(hvd, tmp_path, capsys):
    files = []
    for cap in (4096, 1):  # a few buffers vs one buffer per tensor (layer-wise)
        x, y, _, _ = data()
        torch.manual_seed(0)
        model = DigitsCNN(width=8)
        path = tmp_path / f"cap{cap}.json"
        opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), min_selected=0, density=0.05,
                                       fusion=NaivePlanner(capacity_bytes=cap), timeline=str(path))
        for s in range(5):
            opt.zero_grad()
            F.cross_entropy(model(x[:32]), y[:32]).backward()
            opt.step()
        opt.timeline.close()
        files.append(opt.timeline.path)
    png = tmp_path / "b.png"
    assert main(["timeline", "breakdown", *files, "--labels", "fused,layerwise", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "fused" in out and "layerwise" in out and "NOCT" in out and "collective" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fused, layerwise = (breakdown(f) for f in files)
    assert layerwise.buffers == 16 > fused.buffers  # DigitsCNN has 16 tensors


def test_pause_records_nothing_and_resume_goes_on(hvd, tmp_path):
    x, y, _, _ = data()
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), min_selected=0, density=0.05,
                                   fusion=NaivePlanner(capacity_bytes=4096), timeline=str(tmp_path / "p.json"))
    rec = opt.timeline
    for s in range(9):
        if s in (3, 6):
            rec.pause() if s == 3 else rec.resume()
        opt.zero_grad()
        F.cross_entropy(model(x[:32]), y[:32]).backward()
        opt.step()
    assert opt.timeline is rec
    rec.close()
    steps = sorted(e["args"]["step"] for e in load_events(rec.path) if e.get("name") == "ITERATION")
    assert steps == [1, 2, 7, 8]  # steps 3-5 paused; 0 and 6 have no start


def test_epoch_offset_ignores_a_read_descheduled_between_the_two_clocks(monkeypatch):
    """A rank descheduled between its wall-clock and perf_counter reads must not shift its whole
    timeline: here the first wall-clock read really stalls 5 ms before returning."""
    real_time, calls = time.time, []

    def stalled_time():
        now = real_time()
        if not calls:
            time.sleep(0.005)
        calls.append(now)
        return now

    monkeypatch.setattr(time, "time", stalled_time)
    offset = epoch_offset()
    monkeypatch.setattr(time, "time", real_time)
    reference = epoch_offset(samples=1000)
    assert len(calls) > 1 and abs(offset - reference) < 0.0005, (offset - reference, len(calls))
