"""A real word-level text corpus that needs no download: the Python standard library's source.

Language-model benchmarks (SAFusion's LSTM experiment trains on Penn Treebank) need a stream of
word ids from natural-ish text with a Zipf-like vocabulary, so that the embedding and softmax
tensors are large and their gradients are what a real run sends. Datasets are not downloadable
here, but every Python installation carries megabytes of text: the ``*.py`` files of its standard
library (``sysconfig.get_paths()["stdlib"]``). :func:`stdlib_files` lists them in sorted order
(installed third-party packages under ``site-packages``/``dist-packages`` are skipped, so the
result depends only on the Python version); :func:`tokenize_source` splits one file with the
standard library's own :mod:`tokenize` into names, operators and numbers, every string literal
becomes ``<str>``, comments and indentation are dropped, and every logical line ends with
``<eos>`` (like PTB's sentence ends). Files that do not tokenise (test data written in old
syntax) are skipped. The vocabulary keeps the ``vocab - 1`` most frequent training tokens plus
``<unk>``.

* :func:`stdlib_corpus` — one stream for throughput (about a million tokens from the default
  8 million characters);
* :func:`stdlib_split` — a training and a held-out validation stream, split *by file* (every
  ``k``-th file is held out), for validation perplexity.

Ranks on the same installation get identical corpora. Tokenising takes seconds of CPU per
process, paid by every worker of every job (a benchmark of 8 workers on 2 cores waits for 8 of
them at each start), so the token lists of the files read are kept in a cache file
(``$XDG_CACHE_HOME/horovod-safusion/corpus/``, else ``~/.cache/...``) keyed by the Python
version, this tokeniser's source, ``max_chars`` and every listed file's path, size and
modification time: any change there reads the files again. A cache that cannot be written (a
read-only home) only costs the reading again.
"""
from __future__ import annotations

import collections
import hashlib
import inspect
import io
import os
import pathlib
import pickle
import sys
import sysconfig
import tokenize

import torch

UNK, EOS, STR = "<unk>", "<eos>", "<str>"
_SKIP = {tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER, tokenize.NL}


def stdlib_files(root: str | pathlib.Path | None = None) -> list[pathlib.Path]:
    """The standard library's ``*.py`` files, sorted by relative path, without installed packages."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        found += [pathlib.Path(top, n) for n in names if n.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def tokenize_source(text: str) -> list[str]:
    """Tokens of Python source ``text`` (see the module docstring); ``[]`` if it does not tokenise."""
    out: list[str] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in _SKIP:
                continue
            if tok.type == tokenize.NEWLINE:
                out.append(EOS)
            elif tok.type == tokenize.STRING or tok.type == getattr(tokenize, "FSTRING_START", -1):
                out.append(STR)
            elif tok.type in (getattr(tokenize, "FSTRING_MIDDLE", -1), getattr(tokenize, "FSTRING_END", -1)):
                continue
            else:
                out.append(tok.string)
    except (tokenize.TokenError, SyntaxError):
        return []
    return out


def _cache_path(files: list[pathlib.Path], max_chars: int) -> pathlib.Path:
    """Where :func:`_documents` keeps the token lists of ``files`` read up to ``max_chars``."""
    key = hashlib.sha256(repr((sys.version, inspect.getsource(tokenize_source), max_chars)).encode())
    for path in files:
        st = path.stat()
        key.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return base / "horovod-safusion" / "corpus" / f"{key.hexdigest()}.pickle"


def _documents(root: str | pathlib.Path | None, max_chars: int) -> list[list[str]]:
    """:func:`_read` of :func:`stdlib_files`, from the cache file when it holds them (see the
    module docstring)."""
    files = stdlib_files(root)
    cache = _cache_path(files, max_chars)
    try:
        with open(cache, "rb") as f:
            return pickle.load(f)
    except Exception:  # absent, or cut short or foreign (any unpickling error): read the files again
        pass
    docs = _read(files, max_chars)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{cache.name}.{os.getpid()}")
        with open(partial, "wb") as f:
            pickle.dump(docs, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(partial, cache)  # whole or absent: workers starting together may race here
    except OSError:
        pass
    return docs


def _read(files: list[pathlib.Path], max_chars: int) -> list[list[str]]:
    """Token lists of ``files`` in order, until ``max_chars`` characters are read."""
    docs, chars = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(tokenize_source(text))
        chars += len(text)
        if chars >= max_chars:
            break
    if not any(docs):
        raise RuntimeError(f"no Python source found under {sysconfig.get_paths()['stdlib']}")
    return docs


def _vocabulary(tokens: list[str], vocab: int) -> list[str]:
    if vocab < 2:
        raise ValueError(f"vocab={vocab}: need room for <unk> and at least one token")
    counts = collections.Counter(tokens)
    counts.pop(UNK, None)
    kept = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:vocab - 1]
    return [UNK] + [t for t, _ in kept]


def _ids(tokens: list[str], itos: list[str]) -> torch.Tensor:
    stoi = {t: i for i, t in enumerate(itos)}
    return torch.tensor([stoi.get(t, 0) for t in tokens], dtype=torch.long)


def stdlib_corpus(vocab: int = 10000, max_chars: int = 8_000_000,
                  root: str | pathlib.Path | None = None) -> tuple[torch.Tensor, list[str]]:
    """Token ids (a 1-D LongTensor) of the standard library's source, and the vocabulary.

    Files are read whole, in sorted order, until ``max_chars`` characters are in (deterministic
    for a given Python). The vocabulary is ``<unk>`` (id 0) followed by the ``vocab - 1`` most
    frequent tokens, most frequent first, ties broken alphabetically; rarer tokens map to
    ``<unk>``. ``vocab`` must be at least 2.
    """
    tokens = [t for doc in _documents(root, max_chars) for t in doc]
    itos = _vocabulary(tokens, vocab)
    return _ids(tokens, itos), itos


def stdlib_split(vocab: int = 5000, max_chars: int = 4_000_000, every: int = 10,
                 root: str | pathlib.Path | None = None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``(train_ids, valid_ids, itos)``: every ``every``-th file read (the 0th, ``every``-th, ...)
    is held out for validation, the rest is training text; the vocabulary comes from the training
    files only, so held-out words it lacks are ``<unk>`` as in PTB."""
    if every < 2:
        raise ValueError(f"every={every}: need at least one training file per held-out file")
    docs = _documents(root, max_chars)
    train = [t for i, doc in enumerate(docs) if i % every for t in doc]
    valid = [t for i, doc in enumerate(docs) if not i % every for t in doc]
    itos = _vocabulary(train, vocab)
    return _ids(train, itos), _ids(valid, itos), itos
