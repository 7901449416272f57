"""Saved tokenizers load with transformers' AutoTokenizer (byte, corpus BPE and GPT-2 files) and with load_tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from mhc import train as T
from mhc.train.checkpoint import TOKENIZER_FILES

TEXT = "def f(x):\n    return x ** 2  # ünïcödé ✓ 🚀\n\tprint('hi')\r\n\x00\x7f end"


def _check_auto(tok, directory: Path) -> None:
    directory.mkdir(exist_ok=True)
    tok.save(directory)
    # only files a checkpoint may hold (else resuming would refuse the checkpoints that carry them)
    assert {p.name for p in directory.iterdir()} <= TOKENIZER_FILES
    auto = AutoTokenizer.from_pretrained(directory)
    assert auto(TEXT)["input_ids"] == list(tok.encode(TEXT))  # same ids, nothing added
    assert auto.decode(tok.encode(TEXT)) == TEXT
    assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == tok.eos_id
    again = T.load_tokenizer(directory)
    assert again.kind == tok.kind and list(again.encode(TEXT)) == list(tok.encode(TEXT))


def test_byte_tokenizer_loads_with_auto_tokenizer(tmp_path):
    tok = T.ByteTokenizer()
    _check_auto(tok, tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    every_byte = bytes(range(256)).decode("latin-1")
    assert auto(every_byte)["input_ids"] == list(every_byte.encode("utf-8"))
    assert isinstance(T.load_tokenizer(tmp_path), T.ByteTokenizer)


def test_bpe_and_gpt2_tokenizers_load_with_auto_tokenizer(tmp_path):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "def", "return", "self", "\n", "    "]
    (tmp_path / "data").mkdir()
    for i in range(3):
        (tmp_path / "data" / f"d{i}.txt").write_text(" ".join(rng.choice(words, size=2000)))
    cfg = T.TrainConfig(
        data=str(tmp_path / "data"),
        tokenizer="bpe",
        bpe_vocab_size=300,
        max_steps=1,
        cache_dir=str(tmp_path / "cache"),
        seq_len=16,
    )
    _, bpe, _ = T.prepare_data(cfg, log=lambda *_: None)
    _check_auto(bpe, tmp_path / "bpe")
    (tmp_path / "files").mkdir()
    bpe.tok.model.save(str(tmp_path / "files"))  # vocab.json + merges.txt, as GPT-2 ships them
    gpt2 = T.load_gpt2_tokenizer(tmp_path / "files")
    _check_auto(gpt2, tmp_path / "gpt2")
