"""``make demo``: Horovod and horovod-safusion trained side by side on the same slow link.

    python examples/demo.py [--link 100mbit] [--np 2] [train_digits.py's options ...]

The plugin exists for links slower than the workers: as root, where a network namespace can be
made, the demo runs ``examples/train_digits.py`` under ``horovodrun`` inside a namespace whose
loopback ``tc`` limits to ``--link`` (``benchmarks/links.py``, as the benchmarks do), and the
table names the link. Elsewhere it runs on the plain loopback and says why its times there are no
speed claim.

The link is :data:`LINK`, 100 Mbit/s, shared by the two workers. The digits CNN is small: on a
faster link Horovod's whole job to the target is a few seconds, and a job that short is decided
by the plugin's fixed cost (the online profile, the trial) and its first epochs at low density,
not by its faster steps. At 100 Mbit/s the link sets Horovod's pace, as in the jobs the plugin is
for. docs/benchmarks.md, "The demo", gives the runs at both rates.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
from links import limited_link  # noqa: E402

LINK = "100mbit"  # the emulated link, shared by the workers (see the module docstring)


def why_not_limited() -> str | None:
    """Why this machine cannot emulate a slow link, or None if it can."""
    if os.geteuid() != 0:
        return "not running as root"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"{' and '.join(missing)} not found"
    probe = subprocess.run(["ip", "netns", "add", f"safdemo{os.getpid()}"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"no network namespace can be made here ({probe.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", f"safdemo{os.getpid()}"], check=False)
    return None


def main() -> None:
    argv = sys.argv[1:]
    link, np_ = LINK, "2"
    for flag in ("--link", "--np"):
        if flag in argv:
            i = argv.index(flag)
            value = argv[i + 1]
            del argv[i:i + 2]
            link, np_ = (value, np_) if flag == "--link" else (link, value)
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or "horovodrun"
    job = [horovodrun, "-np", np_, "-H", f"localhost:{np_}", "--gloo", sys.executable,
           os.path.join(HERE, "train_digits.py"), *argv]
    why = why_not_limited()
    if why is not None:
        print(f"demo on the plain loopback ({why}): a link this fast leaves little to save, so its "
              f"times are no speed claim; as root the demo runs on an emulated {LINK} link", flush=True)
        raise SystemExit(subprocess.run(job + ["--link", "loopback (no speed claim)"]).returncode)
    with limited_link(link) as prefix:
        print(f"demo on an emulated {link} link (tc token bucket in a network namespace)", flush=True)
        code = subprocess.run(prefix + job + ["--link", f"{link} (tc, emulated)"]).returncode
    raise SystemExit(code)


if __name__ == "__main__":
    main()
