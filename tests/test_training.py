"""Tests of mhc.train and the training scripts (CPU, a few seconds each)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from training_support import (
    REPO,
    RNG,
    TINY,
    assert_same_run,
    copy_run,
    eval_records,
    subprocess_env,
    tiny_cfg,
)

from mhc import train as T

# ----------------------------------------------------------------------------- config


def test_config_yaml_inheritance_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "hidden_size: 64\nlr: 1.0e-3\nmhc_options: {init: identity}\nmax_steps: 5\n"
    )
    (tmp_path / "child.yaml").write_text(
        "base: base.yaml\nvariant: hc\nmhc_options: {projection: sinkhorn}\n"
    )
    cfg = T.load_config(tmp_path / "child.yaml", ["lr=2e-4", "num_layers=3", "plots=false"])
    assert (cfg.variant, cfg.hidden_size, cfg.num_layers, cfg.lr, cfg.plots) == ("hc", 64, 3, 2e-4, False)
    assert cfg.mhc_options == {"init": "identity", "projection": "sinkhorn"}
    assert cfg.run_dir == str(Path("runs") / "child")
    with pytest.raises(KeyError):
        T.load_config(tmp_path / "child.yaml", ["no_such_key=1"])
    for name in (
        "tiny_cpu_mhc",
        "tiny_cpu_hc",
        "tiny_cpu_residual",
        "small_gpu_mhc",
        "small_gpu_hc",
        "small_gpu_residual",
    ):
        cfg = T.load_config(name)
        assert cfg.variant == name.rsplit("_", 1)[1]


def test_lr_schedule():
    f = [T.lr_lambda(s, 10, 100, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


# ----------------------------------------------------------------------------- data


def _write_docs(root: Path, n: int = 12) -> None:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "mhc", "stream", "def", "return", "x", "\n"]
    for i in range(n):
        sub = root / ("sub" if i % 3 == 0 else "")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, size=3000)))
    (root / "binary.bin").write_bytes(b"\0\1\2")


def test_split_is_deterministic_and_disjoint(tmp_path):
    _write_docs(tmp_path / "data")
    c1 = T.load_corpus(str(tmp_path / "data"))
    assert all(not name.endswith(".bin") for name, _ in c1.documents)
    s1 = T.split_corpus(c1, 0.2, chunk_chars=1000)
    c2 = T.Corpus(list(reversed(c1.documents)), c1.source)  # order must not matter
    s2 = T.split_corpus(T.Corpus(sorted(c2.documents), c2.source), 0.2, chunk_chars=1000)
    assert s1 == s2
    train = {c for r in s1["train"] for c in r}
    val = {c for r in s1["val"] for c in r}
    assert train and val and not (train & val)
    n_chunks = sum(len(r) for r in s1["train"] + s1["val"])
    assert 0.05 < sum(len(r) for r in s1["val"]) / n_chunks < 0.45
    # every character lands in exactly one split
    assert sum(len(c) for r in s1["train"] + s1["val"] for c in r) == c1.num_chars


def test_stdlib_corpus_and_packing(tmp_path):
    cfg = tiny_cfg(tmp_path, max_corpus_mb=0.2)
    data, tok, corpus = T.prepare_data(cfg, log=lambda *_: None)
    assert corpus.source.startswith("stdlib:") and corpus.documents
    assert [n for n, _ in corpus.documents] == sorted(n for n, _ in corpus.documents)
    data2, _, _ = T.prepare_data(cfg, log=lambda *_: None)
    assert np.array_equal(data.train, data2.train) and np.array_equal(data.val, data2.val)
    assert (data.train == tok.eos_id).sum() >= 1
    b1, b2 = data.train_batch(0, 6), data.train_batch(3, 3)
    assert b1.shape == (6, cfg.seq_len) and torch.equal(b1[3:], b2)
    # an epoch visits every window once
    n = data.n_train_windows
    seen = data.train_batch(0, n)
    assert len({tuple(r.tolist()) for r in seen}) == len(
        {tuple(data.train[i * 32 : (i + 1) * 32].tolist()) for i in range(n)}
    )
    h = T.unigram_entropy(np.concatenate([data.train, data.val]), tok.vocab_size)
    assert 2.0 < h < np.log(257)


# ----------------------------------------------------------------------------- tokenizers

TEXT = "def f(x):\n    return x ** 2  # ünïcödé ✓ 🚀\n\tprint('hi')\n"


def test_byte_tokenizer_roundtrip():
    tok = T.ByteTokenizer()
    ids = tok.encode(TEXT)
    assert max(ids) < 256 and tok.decode(ids) == TEXT
    assert tok.decode(ids + [tok.eos_id]) == TEXT


def test_bpe_and_gpt2_files_roundtrip(tmp_path):
    _write_docs(tmp_path / "data", n=4)
    cfg = tiny_cfg(tmp_path, data=str(tmp_path / "data"), tokenizer="bpe", bpe_vocab_size=400)
    data, tok, _ = T.prepare_data(cfg, log=lambda *_: None)
    assert tok.kind == "bpe" and tok.vocab_size <= 400
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert len(list(Path(cfg.cache_dir).glob("bpe-*.json"))) == 1  # cached
    tok2 = T.build_tokenizer(
        cfg, None, T.load_corpus(cfg.data).fingerprint()
    )  # from the cache, no texts needed
    assert tok2.encode(TEXT) == tok.encode(TEXT)
    # GPT-2 style files: vocab.json + merges.txt, and encoder.json + vocab.bpe
    d = tmp_path / "gpt2"
    d.mkdir()
    tok.tok.model.save(str(d))
    g = T.load_gpt2_tokenizer(d)
    assert g.decode(g.encode(TEXT)) == TEXT and g.encode(TEXT) == tok.encode(TEXT)
    d2 = tmp_path / "gpt2b"
    d2.mkdir()
    shutil.copy(d / "vocab.json", d2 / "encoder.json")
    shutil.copy(d / "merges.txt", d2 / "vocab.bpe")
    assert T.load_gpt2_tokenizer(d2).encode(TEXT) == tok.encode(TEXT)
    # saved with a run and loaded back
    tok.save(tmp_path)
    assert T.load_tokenizer(tmp_path).encode(TEXT) == tok.encode(TEXT)


# ----------------------------------------------------------------------------- training, resume, checkpoints


# Attention dropout makes the run draw random numbers at every step, so a resume that did not
# restore the RNG state would train on other dropout masks and its losses would differ.
def test_run_dir_contents_and_from_pretrained(full_run):
    cfg, summary = full_run
    rd = Path(cfg.run_dir)
    for name in (
        "metrics.jsonl",
        "summary.json",
        "loss.png",
        "gains.png",
        "config.yaml",
        "model/config.json",
        "model/model.safetensors",
    ):
        assert (rd / name).is_file(), name
    assert (rd / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["steps"] == 8 and summary["composite_gains"] is not None
    assert len(summary["composite_gains"]["forward_gain"]) == 2 * cfg.num_layers
    assert summary["fwd_gain_full_depth"] == pytest.approx(1.0, abs=1e-3)  # mHC: doubly stochastic
    from transformers import AutoModelForCausalLM

    import mhc  # noqa: F401  (registers the mHC model with the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(rd / "model")
    ids = torch.randint(0, 257, (1, 16))
    ref = T.build_model(cfg, 257, 256).eval()  # eval: no dropout
    from safetensors.torch import load_file

    ref.load_state_dict(load_file(str(rd / "model" / "model.safetensors")), strict=False)
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_saved_model_generates_with_a_transformers_pipeline(full_run):
    """`pipeline("text-generation", model=<run>/model)`: the model and its tokenizer load with the Auto classes."""
    from transformers import pipeline

    import mhc  # noqa: F401  (registers the mHC model with the Auto classes)

    cfg, _ = full_run
    generate = pipeline("text-generation", model=str(Path(cfg.run_dir) / "model"), device="cpu")
    out = generate("def main(", max_new_tokens=6, do_sample=False)
    text = out[0]["generated_text"]
    assert text.startswith("def main(") and len(text) > len("def main("), out
    assert generate.tokenizer("def")["input_ids"] == T.ByteTokenizer().encode("def")


def test_resume_reproduces_uninterrupted_losses(tmp_path, full_run):
    cfg_full, summary_full = full_run
    cfg = tiny_cfg(tmp_path, "resumed", stop_at_step=5, cache_dir=cfg_full.cache_dir, **RNG)
    out = T.train(cfg)
    assert out == {"interrupted": True, "step": 5}
    assert T.find_latest_checkpoint(cfg.run_dir).name == "step_00000003"  # steps 4-5 are lost, as in a crash
    cfg.stop_at_step = 0
    summary = T.train(cfg, resume=True)
    assert_same_run(cfg.run_dir, cfg_full.run_dir)
    assert summary["final_val_loss"] == summary_full["final_val_loss"]
    # a finished run resumes to the end at once
    again = T.train(cfg, resume=True)
    assert again["steps"] == 8 and again["final_val_loss"] == summary["final_val_loss"]
    assert eval_records(cfg.run_dir) == eval_records(cfg_full.run_dir)  # no duplicated records


@pytest.mark.slow  # a training subprocess
def test_bare_resume_cli_continues_the_run_exactly(tmp_path, full_run):
    """README's `python scripts/train_lm.py --resume`, with no other flag: the run's own settings come back."""
    cfg_full, _ = full_run
    # The run lives where the default config puts it (runs/tiny_cpu_mhc under the working directory),
    # but trains with settings that differ from that YAML in almost every key.
    rd = tmp_path / "runs" / "tiny_cpu_mhc"
    cfg = dataclasses.replace(cfg_full, run_dir=str(rd), stop_at_step=5)
    assert T.train(cfg) == {"interrupted": True, "step": 5}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_lm.py"), "--resume"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_00000003" in proc.stdout
    assert_same_run(rd, cfg_full.run_dir)


def test_resume_refuses_changed_settings(tmp_path):
    cfg = tiny_cfg(tmp_path, "changed", stop_at_step=3, max_steps=4)
    T.train(cfg)
    cfg2 = tiny_cfg(tmp_path, "changed", max_steps=4, hidden_size=64, num_heads=2)
    with pytest.raises(T.CheckpointError, match="hidden_size"):
        T.train(cfg2, resume=True)
    with pytest.raises(T.CheckpointError, match="not even with --resume-override"):
        T.train(cfg2, resume=True, resume_override=True)
    with pytest.raises(T.CheckpointError, match=r"lr: run 0\.003, now 0\.001"):
        T.train(tiny_cfg(tmp_path, "changed", max_steps=4, lr=1e-3), resume=True)
    with pytest.raises(FileExistsError, match="--resume"):
        T.train(tiny_cfg(tmp_path, "changed", max_steps=4))


def test_corrupt_or_partial_checkpoint_gives_clear_error(tmp_path, full_run):
    cfg_full, _ = full_run
    # corrupt weights: flip bytes in the middle of model.safetensors
    rd = copy_run(Path(cfg_full.run_dir), tmp_path / "corrupt")
    ck = T.find_latest_checkpoint(rd)
    f = ck / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 8] = b"\xff" * 8
    f.write_bytes(bytes(raw))
    with pytest.raises(T.CheckpointError, match=r"corrupt: model\.safetensors does not match its SHA-256"):
        T.train(tiny_cfg(tmp_path, "corrupt"), resume=True)
    # truncated trainer state
    rd = copy_run(Path(cfg_full.run_dir), tmp_path / "trunc")
    ts = T.find_latest_checkpoint(rd) / "trainer_state.json"
    ts.write_bytes(ts.read_bytes()[:100])
    with pytest.raises(T.CheckpointError, match="trainer_state.json has 100 bytes"):
        T.verify_checkpoint(T.find_latest_checkpoint(rd))
    # a partial write (no manifest)
    rd = copy_run(Path(cfg_full.run_dir), tmp_path / "partial")
    (T.find_latest_checkpoint(rd) / "manifest.json").unlink()
    with pytest.raises(T.CheckpointError, match="partial: it has no manifest.json"):
        T.train(tiny_cfg(tmp_path, "partial"), resume=True)
    # `latest` names a folder that is gone
    rd = copy_run(Path(cfg_full.run_dir), tmp_path / "gone")
    shutil.rmtree(T.find_latest_checkpoint(rd))
    with pytest.raises(T.CheckpointError, match="does not exist"):
        T.find_latest_checkpoint(rd)
    # the script turns it into a one-line error and exit code 2
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "train_lm.py"),
            "--config",
            "tiny_cpu_mhc",
            "--run-dir",
            str(tmp_path / "corrupt"),
            "--resume",
            *sum((["--set", f"{k}={v}"] for k, v in TINY.items()), []),
            "--set",
            f"cache_dir={tmp_path / 'cache'}",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert proc.returncode == 2 and "error: checkpoint" in proc.stderr and "corrupt" in proc.stderr, (
        proc.stderr[-2000:]
    )


def test_atomic_checkpoint_leaves_no_partial_folder(tmp_path, full_run):
    cfg_full, _ = full_run
    root = Path(cfg_full.run_dir) / "checkpoints"
    assert not list(root.glob(".tmp-*"))
    assert sorted(p.name for p in root.glob("step_*")) == [
        "step_00000006",
        "step_00000008",
    ]  # keep_checkpoints=2
    for p in root.glob("step_*"):
        T.verify_checkpoint(p)


def test_write_comparison(tmp_path, full_run):
    cfg_full, _ = full_run
    res = T.write_comparison({"mhc": cfg_full.run_dir, "missing": tmp_path / "nope"}, tmp_path / "cmp")
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| mhc | mhc | 4 |" in md and "no summary" in md
    assert (tmp_path / "cmp" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert res["rows"][0]["final_val_loss"] > 0


def test_eval_records_and_summary_log_stability(full_run):
    """Every eval record has the stability scalars and the per-site H_res marginal error; summary.json the per-site lists."""
    cfg, summary = full_run
    sites = 2 * cfg.num_layers
    evals = [r for r in T.read_metrics(Path(cfg.run_dir) / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4, 8]  # the initial model, then every eval_interval
    assert evals[0]["tokens"] == 0 and evals[0]["val_loss"] > evals[-1]["val_loss"]
    for r in evals:
        assert 0 < r["marginal_error_max"] < 1e-4, r  # exact mHC (Newton)
        assert len(r["marginal_error"]["mean"]) == len(r["marginal_error"]["max"]) == sites, r
        assert max(r["marginal_error"]["max"]) == r["marginal_error_max"], r
        assert all(m <= x for m, x in zip(r["marginal_error"]["mean"], r["marginal_error"]["max"])), r
        if r["step"] == 0:  # the initial model is the residual one: its streams stay copies to the last site
            assert r["stream_spread"] == 0, r
        else:
            assert 0 < r["stream_spread"] <= 1, r  # copies at the start, then they differ
        for key in ("h_res_saturation", "h_res_one_hot_rows", "pre_post_saturation"):
            assert 0 <= r[key] <= 1, (key, r)
    stability = summary["stability"]
    assert (
        stability["spread_mean"][0] == 0.0 and len(stability["spread_mean"]) == sites
    )  # site 0 gets n copies
    assert (
        summary["marginal_error_max"]
        == max(stability["marginal_error_max"])
        == evals[-1]["marginal_error_max"]
    )
    assert summary["stream_spread"] == stability["spread_mean"][-1] == evals[-1]["stream_spread"]
    final = next(r for r in T.read_metrics(Path(cfg.run_dir) / "metrics.jsonl") if r["kind"] == "final")
    assert "stability" not in final and final["h_res_saturation"] == summary["h_res_saturation"]
    md = T.write_comparison({"mhc": cfg.run_dir}, Path(cfg.run_dir).parent / "cmp_stability")["markdown"]
    head, _, row = md.splitlines()[:3]
    cells = dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in row.split("|")]))
    assert cells["max H_res marginal error"] == format(summary["marginal_error_max"], ".2g"), cells
    assert cells["max H_res logit std"] == format(summary["h_res_logit_scale"], ".3g"), cells
    assert summary["h_res_logit_scale"] == max(stability["logit_scale_max"]) > 0
    assert cells["stream spread @ last site"] == format(summary["stream_spread"], ".3g"), cells
    assert cells["max H_res / H_pre,post saturation"] == (
        f"{summary['h_res_saturation']:.3g} / {summary['pre_post_saturation']:.3g}"
    ), cells


def test_measure_stability_per_site_marginal_error_of_a_sinkhorn_model():
    """The per-site marginal error (mean and max over the tokens) that eval records log: against mhc.marginal_error
    of every token's H_res, on a 2-step Sinkhorn model, where tokens differ."""
    from transformers import LlamaConfig

    from mhc import MHCConfig, MHCForCausalLM, marginal_error
    from mhc.diagnostics import collect_h_res
    from mhc.train.reporting import STABILITY_SCALARS, eval_record, measure_stability

    torch.manual_seed(0)
    base = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    model = MHCForCausalLM(
        MHCConfig(base_config=base, n_streams=4, init="paper", projection="sinkhorn", sinkhorn_iters=2)
    )
    ids = torch.randint(0, 64, (2, 16))
    gains, stability = measure_stability(model, ids)
    errors = [marginal_error(h) for h in collect_h_res(model, input_ids=ids, use_cache=False)]
    assert stability["marginal_error_mean"] == pytest.approx([e.mean().item() for e in errors], rel=1e-12)
    assert stability["marginal_error_max"] == pytest.approx([e.max().item() for e in errors], rel=1e-12)
    assert all(e.max() > e.mean() for e in errors)  # the tokens differ: mean and max are two numbers
    record = eval_record(7, 100, 2.5, gains, 1.0, stability)
    assert record["marginal_error"] == {
        "mean": stability["marginal_error_mean"],
        "max": stability["marginal_error_max"],
    }
    assert record["marginal_error_max"] == max(stability["marginal_error_max"]) > 1e-3
    # the spread of the H_res logits per site, and its largest over the sites as a scalar
    assert record["logit_scale"] == {
        "mean": stability["logit_scale_mean"],
        "max": stability["logit_scale_max"],
    }
    assert len(stability["logit_scale_max"]) == len(errors)
    assert record["h_res_logit_scale"] == max(stability["logit_scale_max"]) > 0
    assert set(STABILITY_SCALARS) <= set(record) and record["fwd_gain"] == gains["forward_gain"][-1]
    none = eval_record(7, 100, 2.5, None, 1.0, None)
    assert none["marginal_error"] is None and all(none[k] is None for k in STABILITY_SCALARS)
    assert none["logit_scale"] is None


def test_measure_stability_runs_in_eval_mode_and_leaves_the_rng_alone():
    """The trainer measures at every evaluation on a model in train mode: with attention dropout the
    figures must still be the eval-mode ones, the same every call, and the global RNG must not advance
    (else a resumed run and one with another eval_interval would train differently)."""
    from transformers import LlamaConfig

    from mhc import MHCConfig, MHCForCausalLM
    from mhc.train.reporting import measure_stability

    torch.manual_seed(0)
    base = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        attention_dropout=0.5,
    )
    model = MHCForCausalLM(MHCConfig(base_config=base, n_streams=4, init="paper"))
    ids = torch.randint(0, 64, (2, 16))
    model.eval()
    reference = measure_stability(model, ids)
    model.train()
    model.get_output_embeddings().eval()  # one module in another mode than the rest: flags come back per module
    modes = [m.training for m in model.modules()]
    state = torch.get_rng_state()
    assert measure_stability(model, ids) == reference
    assert torch.equal(torch.get_rng_state(), state)
    assert [m.training for m in model.modules()] == modes
