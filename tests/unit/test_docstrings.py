"""Docstrings and comments say what the code does and why, citing papers by paper and section;
measured figures and their history belong in docs/benchmarks.md. Every module of the package is
read (docstrings with ``ast``, comments with ``tokenize``; code and its string literals are not
checked) for what belongs there instead: a commit hash, a date, a path outside the repository, a
pointer to a README section, or a measured quantity (a time, a rate, a memory size, a speed-up).
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "horovod_safusion"
MODULES = sorted(PACKAGE.rglob("*.py"))

NUMBER = r"\d+(?:[.,]\d+)*"  # the whole number in a report: "0.072 s", "2,332 samples/s"
#: What a docstring or comment must not contain, by what it is.
RULES = {
    # 7 to 40 lowercase hex digits with at least one digit and one letter (so neither a number
    # nor a word like "decade"); "0x..." constants do not match (no word boundary after the x)
    "commit hash": re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "date": re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b"),
    "path outside the repository": re.compile(r"\.\./|(?<![\w.])/(?:work|tmp|root|home)/|\bshared/"),
    # the README is for users; figures go to docs/benchmarks.md (cuda/README.md is a file here)
    "pointer to the README": re.compile(r"\bREADME\b(?!\.md)"),
    "time": re.compile(NUMBER + r"\s*(?:ms|s|sec|min|µs|μs|us|ns|(?:milli|micro|nano)?seconds?)\b"),
    "rate": re.compile(NUMBER + r"\s*(?:[kmgt]i?b/s|[kmg]bit\b|[kmg]bit/s|samples/s|it/s)", re.IGNORECASE),
    "memory size": re.compile(NUMBER + r"\s*[kKMGT]i?B\b"),
    "speed-up": re.compile(NUMBER + r"\s*×|\b\d+\.\d+x\b"),
}

#: Statements of behaviour that match a rule, as ``(module, phrase, why it is no lab note)``: a
#: match inside ``phrase`` in that module's docstrings or comments (whitespace collapsed) passes.
#: Keep it short; a figure measured on a machine goes to docs/benchmarks.md, not here.
ALLOWED = [
    ("cycle.py", "1 ms by default in Horovod 0.28",
     "Horovod's documented default, the behaviour the module changes"),
    ("trial.py", "enough to span 0.2 s", "TRIAL_SECONDS, the module's own constant"),
    ("communicators/base.py", "from 20 µs doubling", "wait()'s first sleep, delay = 2e-5"),
    ("communicators/allreduce.py", "64 MiB by default",
     "Horovod's default HOROVOD_FUSION_THRESHOLD, which fusion_threshold() falls back to"),
    ("timeline/trace.py", "overlap it by 0.001 µs",
     "the rounding of timestamps written with 3 decimals, which tolerance_us absorbs"),
    ("fusion/cupcake.py", "§5.3 reports 2.8 s and 6.6 s",
     "the Cupcake paper's figure, quoted as the paper's"),
]


def texts(source: str) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every docstring (any bare string statement, attribute docstrings
    included) and every block of consecutive comment lines of ``source``, whitespace collapsed."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            yield node.lineno, " ".join(node.value.value.split())
    block: list[str] = []
    first = last = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if block and tok.start[0] != last + 1:
            yield first, " ".join(" ".join(block).split())
            block = []
        if not block:
            first = tok.start[0]
        block.append(tok.string.lstrip("#:"))
        last = tok.start[0]
    if block:
        yield first, " ".join(" ".join(block).split())


def violations(source: str, module: str = "", used: set | None = None) -> list[str]:
    """What ``source``'s docstrings and comments must not say, one line each; the allowed phrases
    of ``module`` (a path relative to the package) that excused a match are added to ``used``."""
    allowed = [(phrase, (m, phrase)) for m, phrase, _ in ALLOWED if m == module]
    found = []
    for line, text in texts(source):
        spans = [(m.start(), m.end(), key) for phrase, key in allowed
                 for m in re.finditer(re.escape(phrase), text)]
        for rule, pattern in RULES.items():
            for m in pattern.finditer(text):
                excuse = next((key for s, e, key in spans if s <= m.start() and m.end() <= e), None)
                if excuse is not None:
                    if used is not None:
                        used.add(excuse)
                    continue
                context = text[max(0, m.start() - 50):m.end() + 50]
                found.append(f"line {line}: {rule} {m.group()!r} in: …{context}…")
    return found


def module_name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


@pytest.mark.parametrize("path", MODULES, ids=module_name)
def test_docstrings_and_comments_hold_no_lab_notes(path):
    found = violations(path.read_text(encoding="utf-8"), module_name(path))
    assert not found, (
        f"{module_name(path)}: docstrings and comments say what and why; move measured figures, "
        "commit hashes, dates and pointers outside the package to docs/benchmarks.md (by section "
        "name), or, for a statement of behaviour, add it to ALLOWED with its reason:\n"
        + "\n".join(found))


def test_every_allowed_phrase_is_still_needed():
    used: set = set()
    for path in MODULES:
        violations(path.read_text(encoding="utf-8"), module_name(path), used)
    stale = [(m, phrase) for m, phrase, _ in ALLOWED if (m, phrase) not in used]
    assert not stale, f"allowed phrases that no longer excuse anything (remove them): {stale}"


@pytest.mark.parametrize("source, rule", [
    ('"""Fixed in 3fa9c2e."""', "commit hash"),
    ("# the plan of 46d8aa6b1f", "commit hash"),
    ('def f():\n    """Measured on 2025-03-14."""', "date"),
    ('"""See ../shared/NOTES.md."""', "path outside the repository"),
    ("# notes in ../notes/out", "path outside the repository"),
    ('"""The figures are in the README, "How fast"."""', "pointer to the README"),
    ("x = 1  # a step took 0.072 s", "time"),
    ('"""Cycles of 12\n    ms cost less."""', "time"),
    ("#: measured on the LSTM at\n#: 200 Mbit/s", "rate"),
    ('"""Copies at 3.2 GB/s."""', "rate"),
    ('"""``make demo`` at 200mbit."""', "rate"),
    ('"""Trained 2332 samples/s."""', "rate"),
    ('"""One 80 MB tensor."""', "memory size"),
    ('"""The plugin was 1.3× faster."""', "speed-up"),
    ('"""3.4x the samples."""', "speed-up"),
])
def test_the_check_finds_lab_notes(source, rule):
    assert any(f": {rule} " in v for v in violations(source)), violations(source)


@pytest.mark.parametrize("source", [
    "SEED = 0x9e3779b97f4a7c15  # SplitMix64's increment",
    'DIGEST = "3fa9c2e1"  # a literal in code is not checked',
    '"""float64 values, int32 indices, SHA-256 digests and 2**24 elements."""',
    '"""Half-decade steps from 0.001 to 0.1; a margin of 20 %; (P − 1)·k rows, 10 steps."""',
    '"""SAFusion §3.3, Eq. 1; SparDL §3.1; see docs/benchmarks.md, "Memory"; cuda/README.md."""',
    '"""A decade, a facade."""',
])
def test_the_check_passes_statements_of_behaviour(source):
    assert violations(source) == []


def test_the_allowed_phrases_excuse_only_their_own_module():
    source = '"""Horovod cycles every HOROVOD_CYCLE_TIME ms (1 ms by default in Horovod 0.28)."""'
    assert violations(source, "cycle.py") == []
    assert violations(source, "trial.py")
