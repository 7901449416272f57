"""Offline training data: a corpus of text files, a deterministic train/validation split, packed token windows.

The default corpus is this Python's own standard-library ``.py`` sources (on every machine,
no download); ``data="python"`` adds every installed package's sources, and any text files or
folders can be given instead. The split depends only on document names and contents, and the
batch order only on ``(seed, global sample index)``, so a resumed run sees the same batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import site
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .checkpoint import atomic_write_bytes
from .config import TrainConfig, cache_root
from .tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = [
    "Corpus",
    "stdlib_dir",
    "load_corpus",
    "split_corpus",
    "PackedData",
    "pack_runs",
    "prepare_data",
    "unigram_entropy",
]


@dataclass
class Corpus:
    """Documents as ``(name, text)``, in a fixed order (sorted by name), and where they came from."""

    documents: list[tuple[str, str]]
    source: str

    @property
    def num_chars(self) -> int:
        """Characters in all documents."""
        return sum(len(t) for _, t in self.documents)

    def fingerprint(self) -> str:
        """16 hex digits of a SHA-256 over names and texts: names the cache files of this corpus."""
        h = hashlib.sha256()
        for name, text in self.documents:
            h.update(name.encode("utf-8", "surrogatepass") + b"\0")
            h.update(text.encode("utf-8", "surrogatepass") + b"\1")
        return h.hexdigest()[:16]


def stdlib_dir() -> Path:
    """The standard library's source folder of the running Python."""
    return Path(sysconfig.get_paths()["stdlib"])


def _site_dirs() -> list[Path]:
    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with contextlib.suppress(AttributeError):  # virtualenv's old site.py has no getsitepackages
        dirs.update(site.getsitepackages())
    return sorted(Path(d) for d in dirs if Path(d).is_dir())


def _read_text(path: Path) -> str | None:
    """The file as UTF-8 text, or None if it cannot be read, holds a NUL byte or is not UTF-8."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _walk(root: Path, suffixes: tuple[str, ...], skip_dirs: tuple[str, ...] = ()) -> list[Path]:
    """Files under ``root`` in sorted order, hidden names and ``__pycache__`` left out."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip_dirs and d != "__pycache__")
        for fn in sorted(filenames):
            if fn.startswith("."):
                continue
            if suffixes and not fn.endswith(suffixes):
                continue
            out.append(Path(dirpath) / fn)
    return out


def _python_sources(with_site_packages: bool) -> tuple[list[tuple[str, Path]], str]:
    root = stdlib_dir()
    paths = [(p.relative_to(root).as_posix(), p) for p in _walk(root, (".py",), ("site-packages", "dist-packages"))]
    if not with_site_packages:
        return paths, f"stdlib:{root}"
    seen = set()
    for sp in _site_dirs():
        for p in _walk(sp, (".py",)):
            rp = os.path.realpath(p)
            if rp not in seen:
                seen.add(rp)
                paths.append(("site-packages/" + p.relative_to(sp).as_posix(), p))
    return paths, f"python sources: stdlib {root} + site-packages"


def _given_files(data: str, extensions: str) -> list[tuple[str, Path]]:
    suffixes = tuple(s.strip() if s.strip().startswith(".") else "." + s.strip() for s in extensions.split(",") if s.strip())
    paths: list[tuple[str, Path]] = []
    for item in [s.strip() for s in data.split(",") if s.strip()]:
        p = Path(item).expanduser()
        if p.is_dir():
            paths += [(f"{p.name}/{f.relative_to(p).as_posix()}", f) for f in _walk(p, suffixes)]
        elif p.is_file():
            if _read_text(p) is None:
                raise ValueError(f"{p} is not UTF-8 text")
            paths.append((p.name, p))
        else:
            raise FileNotFoundError(f"data path {p} does not exist")
    return paths


def load_corpus(data: str = "stdlib", extensions: str = "", max_mb: float = 0.0) -> Corpus:
    """Read the documents of ``data``.

    Args:
        data: ``"stdlib"`` (this Python's own standard-library ``.py`` sources,
            without ``site-packages``), ``"python"`` (the standard library plus
            every installed package's ``.py`` sources: more text, but it differs
            between machines), or comma-separated text files and folders.
        extensions: for folders, comma-separated file suffixes to keep (``""``: all
            files that decode as UTF-8 and hold no NUL byte).
        max_mb: keep documents (in name order) until this many MB of text; 0 keeps all.
    """
    if data in ("stdlib", "python"):
        paths, source = _python_sources(with_site_packages=data == "python")
    else:
        paths, source = _given_files(data, extensions), data
    paths.sort(key=lambda t: t[0])
    budget = int(max_mb * 1e6) if max_mb and max_mb > 0 else None
    docs: list[tuple[str, str]] = []
    for name, p in paths:
        if budget is not None and budget <= 0:
            break
        text = _read_text(p)
        if text:
            docs.append((name, text))
            if budget is not None:
                budget -= len(text)
    if not docs:
        raise ValueError(f"no text documents found in {data!r}")
    return Corpus(docs, source)


def _in_val(name: str, index: int, val_fraction: float) -> bool:
    h = hashlib.blake2b(f"{name}\0{index}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64 < val_fraction


def split_corpus(corpus: Corpus, val_fraction: float = 0.05, chunk_chars: int = 8192) -> dict[str, list[list[str]]]:
    """Deterministic train/validation split.

    Every document is cut into chunks of ``chunk_chars`` characters; a chunk goes
    to validation when a hash of ``(document name, chunk index)`` falls under
    ``val_fraction``. The split depends on names and contents only, not on file
    order or the machine. Returns, per split, runs of consecutive chunks
    (each run is written with an end-of-text token after it).
    """
    out: dict[str, list[list[str]]] = {"train": [], "val": []}
    for name, text in corpus.documents:
        runs: dict[str, list[str]] = {"train": [], "val": []}
        last = None
        for i in range(0, max(len(text), 1), chunk_chars):
            split = "val" if _in_val(name, i // chunk_chars, val_fraction) else "train"
            if split != last and runs[split]:  # a gap: close the run
                out[split].append(runs[split])
                runs[split] = []
            runs[split].append(text[i : i + chunk_chars])
            last = split
        for split in ("train", "val"):
            if runs[split]:
                out[split].append(runs[split])
    if not out["val"] or not out["train"]:
        # Tiny corpora: fall back to the last chunk of the last document for validation.
        chunks = [(s, r) for s in ("train", "val") for r in out[s]]
        flat = [c for _, r in chunks for c in r]
        if len(flat) < 2:
            raise ValueError("the corpus is too small to split into train and validation")
        n_val = max(1, int(round(len(flat) * val_fraction)))
        out = {"train": [flat[:-n_val]], "val": [flat[-n_val:]]}
    return out


@dataclass
class PackedData:
    """Token streams per split, packed into non-overlapping ``seq_len`` windows.

    Batches depend only on ``(seed, global sample index)``: epoch ``e`` visits the
    training windows in the order ``randperm(n, generator=seed·1000003 + e)``, and
    global sample ``i`` is window ``perm_e[i mod n]`` with ``e = i // n``. So a run's
    data position is its step count, and a resumed run sees the same batches.
    """

    train: np.ndarray
    val: np.ndarray
    seq_len: int
    seed: int
    vocab_size: int
    eos_id: int
    _perm_cache: dict = field(default_factory=dict, repr=False)

    @property
    def n_train_windows(self) -> int:
        """Training windows of ``seq_len`` tokens."""
        return len(self.train) // self.seq_len

    @property
    def n_val_windows(self) -> int:
        """Validation windows of ``seq_len`` tokens."""
        return len(self.val) // self.seq_len

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
            self._perm_cache.clear()
            self._perm_cache[epoch] = torch.randperm(self.n_train_windows, generator=g).numpy()
        return self._perm_cache[epoch]

    def train_batch(self, start: int, count: int) -> Tensor:
        """Global training samples ``start .. start+count-1`` as ``[count, seq_len]`` int64."""
        n, L = self.n_train_windows, self.seq_len
        rows = []
        for i in range(start, start + count):
            w = int(self._perm(i // n)[i % n])
            rows.append(self.train[w * L : (w + 1) * L])
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def val_windows(self, count: int) -> Tensor:
        """A fixed, evenly spaced set of ``count`` validation windows, ``[<=count, seq_len]`` int64."""
        n, L = self.n_val_windows, self.seq_len
        if n == 0:
            raise ValueError(f"the validation split holds fewer than seq_len={L} tokens")
        idx = np.unique(np.linspace(0, n - 1, num=min(count, n)).round().astype(np.int64))
        return torch.from_numpy(np.stack([self.val[i * L : (i + 1) * L] for i in idx]).astype(np.int64))


def pack_runs(tok: ByteTokenizer | HFTokenizer, runs: list[list[str]]) -> np.ndarray:
    """Encode runs of chunks into one token stream, an end-of-text token after each run.

    Returns uint16 when the vocabulary fits, else int32; shape (tokens,).
    """
    flat = [c for r in runs for c in r]
    ends = np.cumsum([len(r) for r in runs])
    encoded = tok.encode_batch(flat) if flat else []
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.int32
    parts, j = [], 0
    eos = np.array([tok.eos_id], dtype=dtype)
    for k, arr in enumerate(encoded):
        parts.append(arr.astype(dtype, copy=False))
        if j < len(ends) and k + 1 == ends[j]:
            parts.append(eos)
            j += 1
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _bpe_texts(splits: dict[str, list[list[str]]], train_mb: float) -> Iterator[str]:
    """The training chunks, in order, up to ``train_mb`` MB (0: all)."""
    left = train_mb * 1e6 if train_mb > 0 else float("inf")
    for run in splits["train"]:
        for chunk in run:
            if left <= 0:
                return
            left -= len(chunk)
            yield chunk


def prepare_data(cfg: TrainConfig, log=print) -> tuple[PackedData, ByteTokenizer | HFTokenizer, Corpus]:
    """Load the corpus, split it, build the tokenizer and pack both splits.

    Token arrays of non-byte tokenizers are cached under the cache dir (as ``.npy``, loaded
    with ``allow_pickle=False``).
    """
    corpus = load_corpus(cfg.data, cfg.data_extensions, cfg.max_corpus_mb)
    corpus_id = corpus.fingerprint()
    splits = split_corpus(corpus, cfg.val_fraction, cfg.split_chunk_chars)
    tok = build_tokenizer(cfg, _bpe_texts(splits, cfg.bpe_train_mb), corpus_id)
    arrays = {}
    cache = cache_root(cfg) / f"tokens-{corpus_id}-{tok.fingerprint()}-{cfg.val_fraction}-{cfg.split_chunk_chars}"
    for split in ("train", "val"):
        path = cache.with_name(cache.name + f"-{split}.npy")
        if tok.kind != "byte" and path.is_file():
            arrays[split] = np.load(path, allow_pickle=False)
            continue
        arrays[split] = pack_runs(tok, splits[split])
        if tok.kind != "byte":
            buf = io.BytesIO()
            np.save(buf, arrays[split])
            atomic_write_bytes(path, buf.getvalue())
    data = PackedData(arrays["train"], arrays["val"], cfg.seq_len, cfg.seed, tok.vocab_size, tok.eos_id)
    if data.n_train_windows == 0:
        raise ValueError(f"the training split holds fewer than seq_len={cfg.seq_len} tokens")
    log(
        f"data: {len(corpus.documents)} documents, {corpus.num_chars / 1e6:.2f}M chars from {corpus.source}; "
        f"tokens train {len(data.train):,} / val {len(data.val):,} ({tok.kind} tokenizer, vocab {tok.vocab_size})"
    )
    return data, tok, corpus


def unigram_entropy(tokens: np.ndarray, vocab_size: int | None = None) -> float:
    """Entropy in nats of the empirical unigram distribution of ``tokens`` (any integer array)."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size or 0).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
