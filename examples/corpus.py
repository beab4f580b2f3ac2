"""A real word-level text corpus that needs no download: the Python standard library's source.

Language-model benchmarks (SAFusion's LSTM experiment trains on Penn Treebank) need a stream of
word ids from natural-ish text with a Zipf-like vocabulary, so that the embedding and softmax
tensors are large and their gradients are what a real run sends. Datasets are not downloadable
here, but every Python installation carries megabytes of text: the ``*.py`` files of its standard
library (``sysconfig.get_paths()["stdlib"]``). :func:`stdlib_corpus` reads them in sorted order
(installed third-party packages under ``site-packages``/``dist-packages`` are skipped, so the
result depends only on the Python version), splits them into identifiers, numbers and single
punctuation characters, ends every non-empty line with ``<eos>`` (like PTB's sentence ends) and
keeps the ``vocab - 1`` most frequent tokens plus ``<unk>``. The default 8 million characters give
about 1.9 million tokens (PTB's training set has 0.9 million) in about two seconds, so nothing is
cached on disk. Ranks on the same installation get identical corpora.
"""
from __future__ import annotations

import collections
import pathlib
import re
import sysconfig

import torch

UNK, EOS = "<unk>", "<eos>"
TOKEN = re.compile(r"[A-Za-z_]\w*|\d+(?:\.\d+)?|[^\s\w]")
"""Identifiers/words, integers and decimals, or one punctuation character."""


def stdlib_files(root: str | pathlib.Path | None = None) -> list[pathlib.Path]:
    """The standard library's ``*.py`` files, sorted by relative path, without installed packages."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted((p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)),
                  key=lambda p: p.relative_to(root).as_posix())


def tokenize(text: str) -> list[str]:
    """Tokens of ``text``, with ``<eos>`` after every non-empty line."""
    out: list[str] = []
    for line in text.splitlines():
        toks = TOKEN.findall(line)
        if toks:
            out.extend(toks)
            out.append(EOS)
    return out


def stdlib_corpus(vocab: int = 10000, max_chars: int = 8_000_000,
                  root: str | pathlib.Path | None = None) -> tuple[torch.Tensor, list[str]]:
    """Token ids (a 1-D LongTensor) of the standard library's source, and the vocabulary.

    Files are read whole, in sorted order, until ``max_chars`` characters are in (deterministic
    for a given Python). The vocabulary is ``<unk>`` (id 0) followed by the ``vocab - 1`` most
    frequent tokens, most frequent first, ties broken alphabetically; rarer tokens map to
    ``<unk>``. ``vocab`` must be at least 2.
    """
    if vocab < 2:
        raise ValueError(f"vocab={vocab}: need room for <unk> and at least one token")
    tokens: list[str] = []
    chars = 0
    for path in stdlib_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        tokens.extend(tokenize(text))
        chars += len(text)
        if chars >= max_chars:
            break
    if not tokens:
        raise RuntimeError(f"no Python source found under {root or sysconfig.get_paths()['stdlib']}")
    counts = collections.Counter(tokens)
    counts.pop(UNK, None)
    kept = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:vocab - 1]
    itos = [UNK] + [t for t, _ in kept]
    stoi = {t: i for i, t in enumerate(itos)}
    ids = torch.tensor([stoi.get(t, 0) for t in tokens], dtype=torch.long)
    return ids, itos
