"""``python -m horovod_safusion``: list the registries, print a model's plan."""
import json

from horovod_safusion.__main__ import main


def test_list_names_every_registry(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("dgc", "topk", "none", "safusion-naive", "allgather", "allreduce"):
        assert f"  {name} " in out


def test_plan_prints_the_table_and_writes_json(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "digits:DigitsCNN", "--capacity-bytes", "20000", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "16 parameter tensors, 45,418 elements" in out
    plan = json.loads(path.read_text())
    assert plan["buffers"][0][0] == "head.3.bias" and len(plan["buffers"]) == 7
