"""The word-level corpus from Python source (``examples/corpus.py``) and its cache of token lists."""
import torch

import corpus

SOURCES = {
    "a.py": "x = 1\nprint(x, 'hi')\n",
    "pkg/b.py": "def f(y):\n    return y + 1  # comment\n",
    "site-packages/skipped.py": "z = 3\n",
}


def tree(root, sources=SOURCES):
    for rel, text in sources.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_files_sorted_and_installed_packages_skipped(tmp_path):
    files = corpus.stdlib_files(tree(tmp_path / "lib"))
    assert [p.relative_to(tmp_path / "lib").as_posix() for p in files] == ["a.py", "pkg/b.py"]


def test_tokens_and_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ids, itos = corpus.stdlib_corpus(vocab=100, root=tree(tmp_path / "lib"))
    tokens = [itos[i] for i in ids.tolist()]
    assert tokens[:9] == ["x", "=", "1", "<eos>", "print", "(", "x", ",", "<str>"]
    assert "comment" not in tokens and "z" not in tokens
    assert itos[0] == "<unk>"


def test_cache_gives_the_same_corpus_and_follows_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tree(tmp_path / "lib")
    first = corpus.stdlib_corpus(vocab=100, root=root)
    cached = list((tmp_path / "cache" / "horovod-safusion" / "corpus").iterdir())
    assert len(cached) == 1 and cached[0].suffix == ".pickle"
    again = corpus.stdlib_corpus(vocab=100, root=root)
    assert torch.equal(first[0], again[0]) and first[1] == again[1]

    (root / "a.py").write_text("w = 2\n")  # another size: read again, not the stale tokens
    changed_ids, changed_itos = corpus.stdlib_corpus(vocab=100, root=root)
    assert [changed_itos[i] for i in changed_ids.tolist()][:4] == ["w", "=", "2", "<eos>"]


def test_unreadable_cache_is_read_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tree(tmp_path / "lib")
    first = corpus.stdlib_corpus(vocab=100, root=root)
    (cached,) = (tmp_path / "cache" / "horovod-safusion" / "corpus").iterdir()
    cached.write_bytes(b"\x80truncated")
    assert torch.equal(corpus.stdlib_corpus(vocab=100, root=root)[0], first[0])


def test_unwritable_cache_still_gives_the_corpus(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    ids, itos = corpus.stdlib_corpus(vocab=100, root=tree(tmp_path / "lib"))
    assert len(ids) > 0
