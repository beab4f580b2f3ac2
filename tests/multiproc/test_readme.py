"""The README's quick start, as a user copies it: the script into ``train.py``, the launch line as
printed, run from a directory of its own. If the README's example stops working, this fails."""
import os
import re
import shlex
import sys

import pytest

from launch import ROOT, run

pytestmark = pytest.mark.multiproc


def quick_start() -> tuple[str, str]:
    """The first Python block and the first ``horovodrun`` line of the README's Quick start."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    script = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    command = next(line for block in re.findall(r"```bash\n(.*?)```", section, re.S)
                   for line in block.splitlines() if line.startswith("horovodrun"))
    return script, command


def test_the_quick_start_runs_as_printed(tmp_path):
    script, command = quick_start()
    argv = shlex.split(command)
    assert argv[-2:] == ["python", "train.py"], f"the README launches something else: {command}"
    (tmp_path / "train.py").write_text(script)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = run(argv, timeout=300, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, f"{command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    losses = [float(v) for v in re.findall(r"epoch \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 10, proc.stdout[-3000:]
    assert losses[-1] < 0.5 * losses[0], f"the quick start did not learn: {losses}"
