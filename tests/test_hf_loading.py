"""Loading mHC models (CPU).

* a saved model loads through ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` in a
  fresh process that never imports mhc (the saved ``modeling_mhc.py`` + ``auto_map``), as mhc's own classes,
  with the saving process's logits; after ``import mhc`` the plain call loads it; without mhc-torch
  installed the error says how to install mhc-torch from its repository;
* ``MHCForCausalLM.from_pretrained`` refuses weights holding NaN or Inf, naming the tensors;
* :func:`mhc.convert_to_mhc` refuses a model without an LM head, naming it;
* an :class:`mhc.MHCConfig` whose recorded adapter does not fit its base model says which disagree.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_hf import ARCHS, ids, perturb_mhc, tiny_base, tiny_config
from transformers import AutoModelForCausalLM, GPT2Model, LlamaModel

import mhc
from mhc import MHCBlock, MHCConfig, MHCForCausalLM, StreamReduce, convert_to_mhc
from mhc.hf.adapters import ADAPTERS
from mhc.hf.custom_code import AUTO_MAP, CODE_FILE, INSTALL, code_source
from mhc.hf.verify import NonFiniteWeightsError

ROOT = Path(__file__).resolve().parent.parent

# Put first in a child's script: `mhc` cannot be imported, whatever provides it (this checkout on
# PYTHONPATH, an editable install's finder on sys.meta_path, or site-packages), as if not installed.
HIDE_MHC = """
import importlib.abc, sys

class _NoMhc(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mhc" or name.startswith("mhc."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoMhc())
"""


def run_python(script: str, cwd: Path, *, hide_mhc: bool = False) -> str:
    """Run ``script`` in a fresh Python; returns its stdout, fails the test if it exits non-zero.

    The child imports this checkout's mhc (first on PYTHONPATH, ahead of any installed copy), or none
    with ``hide_mhc``; the rest of this process's PYTHONPATH (another transformers, say) is kept;
    transformers' custom-code cache goes under ``cwd``; no network.
    """
    env = dict(
        os.environ, HF_MODULES_CACHE=str(cwd / "hf_modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"
    )
    script = textwrap.dedent(script)
    if hide_mhc:
        script = HIDE_MHC + script
    else:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture
def saved_with_logits(tmp_path) -> tuple[Path, Path]:
    """A converted tiny Llama (coefficients moved off the identity) saved in ``model/``, and ``reference.safetensors``
    with the input ids and the logits this process computes for them."""
    model = convert_to_mhc(tiny_base("llama"), n_streams=2)
    perturb_mhc(model)
    model.save_pretrained(tmp_path / "model")
    x = ids()
    with torch.no_grad():
        logits = model(x).logits
    save_file({"input_ids": x, "logits": logits}, str(tmp_path / "reference.safetensors"))
    return tmp_path / "model", tmp_path / "reference.safetensors"


def test_save_pretrained_writes_the_loader_and_leaves_the_config_alone(saved_with_logits):
    folder, _ = saved_with_logits
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["model_type"] == "mhc"
    source = (folder / CODE_FILE).read_text()
    assert "from mhc.hf import MHCConfig, MHCForCausalLM" in source and INSTALL in source
    assert "pip install mhc-torch" not in source  # not on PyPI: that name could install anything
    compile(source, CODE_FILE, "exec")
    model = MHCForCausalLM(MHCConfig(base_config=tiny_config("llama"), n_streams=2))
    model.config.auto_map = {"AutoTokenizer": ["tok.Tok", None]}
    model.save_pretrained(folder.parent / "again")
    assert model.config.auto_map == {"AutoTokenizer": ["tok.Tok", None]}  # the in-memory config as it was
    saved = json.loads((folder.parent / "again" / "config.json").read_text())["auto_map"]
    assert saved == {"AutoTokenizer": ["tok.Tok", None], **AUTO_MAP}
    del model.config.auto_map
    model.save_pretrained(folder.parent / "again")
    assert "auto_map" not in model.config.__dict__
    # save_pretrained(push_to_hub=True) uploads what changed after this listing: the loader always counts as new
    assert set(model._get_files_timestamps(folder)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
    }


def test_a_training_run_s_model_folder_carries_the_loader_too(tmp_path):
    """mhc-train writes model/ and checkpoints with write_model_dir, not save_pretrained: the same loader goes in
    (only for mHC configs), the config object is left alone, and a checkpoint's manifest accepts the file."""
    from mhc.train.checkpoint import ALLOWED_FILES, write_model_dir

    model = convert_to_mhc(tiny_base("llama"), n_streams=2)
    write_model_dir(tmp_path / "mhc", model.config, model.state_dict(), None)
    assert json.loads((tmp_path / "mhc" / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert (tmp_path / "mhc" / CODE_FILE).read_text() == code_source()
    assert "auto_map" not in model.config.__dict__ and CODE_FILE in ALLOWED_FILES
    loaded = MHCForCausalLM.from_pretrained(tmp_path / "mhc")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    base = tiny_base("llama")  # a residual run's folder is a plain Llama one
    write_model_dir(tmp_path / "residual", base.config, base.state_dict(), None)
    assert not (tmp_path / "residual" / CODE_FILE).exists()
    assert "auto_map" not in json.loads((tmp_path / "residual" / "config.json").read_text())


@pytest.mark.slow
def test_loads_with_trust_remote_code_in_a_process_without_import_mhc(saved_with_logits, tmp_path):
    """The folder loads in a fresh process that never imports mhc: trust_remote_code=True runs the saved
    modeling_mhc.py, which imports mhc's classes; the logits are this process's, bit for bit. Without
    trust_remote_code transformers refuses and runs nothing. Saved again, it carries the loader, not mhc's
    source files."""
    folder, reference = saved_with_logits
    out = run_python(
        f"""
        import os, sys
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        try:
            AutoModelForCausalLM.from_pretrained({str(folder)!r})
        except ValueError as err:
            assert "trust_remote_code=True" in str(err), err
        else:
            raise AssertionError("loaded without trust_remote_code")
        assert "mhc" not in sys.modules  # nothing ran

        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        import mhc
        assert mhc.__file__ == {mhc.__file__!r}, mhc.__file__
        assert type(model) is mhc.MHCForCausalLM and type(model.config) is mhc.MHCConfig, type(model)
        ref = load_file({str(reference)!r})
        with torch.no_grad():
            logits = model(ref["input_ids"]).logits
        assert torch.equal(logits, ref["logits"]), (logits - ref["logits"]).abs().max()
        model.save_pretrained({str(tmp_path / "again")!r})
        print("files:", ",".join(sorted(os.listdir({str(tmp_path / "again")!r}))))
    """,
        tmp_path,
    )
    files = out.split("files:")[1].strip().split(",")
    assert CODE_FILE in files and not {"config.py", "modeling.py", "adapters.py"} & set(files), files
    assert (tmp_path / "again" / CODE_FILE).read_text() == (folder / CODE_FILE).read_text()


@pytest.mark.slow
def test_plain_from_pretrained_after_import_mhc(saved_with_logits, tmp_path):
    """After `import mhc` (before transformers, in a fresh process) the plain call loads the folder, and so
    does trust_remote_code=True: mhc's classes either way, the same logits."""
    folder, reference = saved_with_logits
    run_python(
        f"""
        import mhc
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        ref = load_file({str(reference)!r})
        for kwargs in ({{}}, {{"trust_remote_code": True}}):
            model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, **kwargs)
            assert type(model) is mhc.MHCForCausalLM and type(model.config) is mhc.MHCConfig, type(model)
            with torch.no_grad():
                assert torch.equal(model(ref["input_ids"]).logits, ref["logits"])
    """,
        tmp_path,
    )
    # and in this process, which imported mhc long ago
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model) is MHCForCausalLM


def test_without_mhc_installed_the_error_says_how_to_install_mhc_torch(saved_with_logits, tmp_path):
    folder, _ = saved_with_logits
    out = run_python(
        f"""
        import importlib.util
        try:
            importlib.util.find_spec("mhc")
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("mhc is not hidden")
        from transformers import AutoModelForCausalLM

        try:
            AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        except ImportError as err:
            print("ERROR:", err)
        else:
            raise AssertionError("loaded without mhc")
    """,
        tmp_path,
        hide_mhc=True,
    )
    assert "git+https://github.com/mhc-torch/mhc.git" in out and "No module named 'mhc'" in out, out


def corrupt_safetensors(path: Path, tensor: str, pattern: bytes, nbytes: int = 64, offset: int = 0) -> None:
    """Overwrite ``nbytes`` bytes of ``tensor``'s data in a safetensors file (its payload, not the header)."""
    raw = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8 : 8 + header_len])[tensor]["data_offsets"]
    assert offset + nbytes <= end - start
    at = 8 + header_len + start + offset
    raw[at : at + nbytes] = (pattern * nbytes)[:nbytes]
    path.write_bytes(bytes(raw))


@pytest.fixture
def saved_llama(tmp_path) -> Path:
    model = convert_to_mhc(tiny_base("llama"), n_streams=2)
    perturb_mhc(model)
    model.save_pretrained(tmp_path)
    return tmp_path


NAN_F32 = struct.pack("<I", 0x7FC00000)
POS_INF_F32 = struct.pack("<f", float("inf"))
NEG_INF_F32 = struct.pack("<f", float("-inf"))


def test_loading_weights_with_nan_or_inf_raises_naming_the_tensors(saved_llama):
    """64 damaged bytes in the payload: before, the model loaded silently and computed NaN logits."""
    weights = saved_llama / "model.safetensors"
    corrupt_safetensors(weights, "model.model.layers.1.self_attn.q_proj.weight", NAN_F32, offset=256)
    corrupt_safetensors(weights, "model.model.layers.0.mlp_mhc.phi", POS_INF_F32, nbytes=8)
    corrupt_safetensors(weights, "model.model.norm.weight", NEG_INF_F32, nbytes=4, offset=12)
    for load in (MHCForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(NonFiniteWeightsError) as info:
            load(saved_llama)
        msg = str(info.value)
        assert isinstance(info.value, ValueError)
        assert "3 of " in msg and str(saved_llama) in msg, msg
        assert "model.model.layers.1.self_attn.q_proj.weight (16 NaN of 1024)" in msg, msg
        assert "model.model.layers.0.mlp_mhc.phi (2 +Inf of 512)" in msg, msg
        assert "model.model.norm.weight (1 -Inf of 32)" in msg, msg
        assert "self_attn.k_proj" not in msg and "check_finite=False" in msg, msg
    # The opt-out loads it as it is (and it computes NaN).
    model = MHCForCausalLM.from_pretrained(saved_llama, check_finite=False)
    with torch.no_grad():
        assert model(ids()).logits.isnan().any()
    assert not hasattr(model.config, "check_finite")


def test_loading_finite_weights_passes_and_returns_loading_info(saved_llama):
    model, info = MHCForCausalLM.from_pretrained(saved_llama, output_loading_info=True)
    assert isinstance(model, MHCForCausalLM) and not info["missing_keys"]


@pytest.mark.parametrize("verify", [None, False])
@pytest.mark.parametrize(
    "arch,headless,causal",
    [("llama", LlamaModel, "LlamaForCausalLM"), ("gpt2", GPT2Model, "GPT2LMHeadModel")],
)
def test_convert_refuses_a_model_without_lm_head(arch, headless, causal, verify):
    """A headless base model (what AutoModel loads) is refused before anything runs, naming its class and
    the causal-LM class to load instead (before: AttributeError about `logits`, or about `model` with
    verify=False)."""
    model = headless(tiny_config(arch))
    with pytest.raises(ValueError) as info:
        convert_to_mhc(model, n_streams=2, verify=verify)
    msg = str(info.value)
    assert headless.__name__ in msg and causal in msg and "LM head" in msg, msg
    assert "AutoModelForCausalLM" in msg, msg
    assert not any(type(m).__name__ == "MHCDecoderLayer" for m in model.modules())  # left as it was


def test_config_whose_adapter_does_not_fit_its_base_model_type():
    """A GPT-2 base config with Llama's adapter names both and the fix (before: "GPT2LMHeadModel has no
    attribute `model`")."""
    cfg = MHCConfig(base_config=tiny_config("gpt2"), n_streams=2, adapter=ADAPTERS["llama"])
    with pytest.raises(ValueError) as info:
        MHCForCausalLM(cfg)
    msg = str(info.value)
    assert "'gpt2'" in msg and "GPT2LMHeadModel" in msg, msg
    assert "'model.layers'" in msg and "'transformer.h'" in msg, msg  # what the adapter names, where they are
    assert "llama" in msg, msg  # whose adapter it is
    assert "adapter=None" in msg, msg  # the fix
    # The fix works: the registered adapter of the base model_type.
    cfg.adapter = None
    assert isinstance(MHCForCausalLM(cfg), MHCForCausalLM)


def test_convert_with_an_adapter_that_does_not_fit_names_it():
    """An explicit adapter whose layer path is not in the model: the same message, the model left unconverted."""
    base = tiny_base("gpt2")
    with pytest.raises(ValueError, match="'model.layers'") as info:
        convert_to_mhc(base, n_streams=2, adapter=ADAPTERS["llama"])
    assert "GPT2LMHeadModel" in str(info.value)
    assert not any(type(m).__name__ == "MHCDecoderLayer" for m in base.modules())


def test_nonfinite_tensors_covers_every_dtype_once_and_skips_computed_buffers():
    """Every floating dtype (float8 through its float32 fallback) and complex; integer tensors, meta tensors
    and non-persistent buffers (computed by the model's code, not loaded) are not checked; a shared
    parameter is named once."""
    from mhc.hf.verify import nonfinite_tensors

    m = torch.nn.Module()
    for i, dtype in enumerate(
        (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e5m2)
    ):
        good, bad = (
            torch.zeros(5, 3, dtype=dtype),
            torch.zeros(5, 3).index_fill_(0, torch.tensor([2]), math.inf),
        )
        m.register_parameter(f"good{i}", torch.nn.Parameter(good, requires_grad=False))
        m.register_parameter(f"bad{i}", torch.nn.Parameter(bad.to(dtype), requires_grad=False))
    m.register_buffer("cbad", torch.tensor([1 + 1j, complex(0, math.nan)]))
    m.register_buffer("ints", torch.arange(4))
    m.register_buffer("mask", torch.full((3,), -math.inf), persistent=False)
    m.register_parameter("offloaded", torch.nn.Parameter(torch.empty(4, device="meta")))
    m.child = torch.nn.Linear(2, 2)
    with torch.no_grad():
        m.child.bias[1] = math.nan
    m.alias = m.child  # the same parameters under a second name
    assert nonfinite_tensors(m) == ["bad0", "bad1", "bad2", "bad3", "bad4", "cbad", "child.bias"]


# ----------------------------------------------------------------------------- checkpoints of other settings


@contextlib.contextmanager
def empty_memory_is_nan():
    """torch.empty gives NaN-filled tensors, so a parameter nobody initialised cannot pass for a value."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        assert torch.empty(3).isnan().all()
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling


def mhc_parameters(model: MHCForCausalLM) -> dict[str, torch.Tensor]:
    return {
        n: p
        for m_name, m in model.named_modules()
        if isinstance(m, (MHCBlock, StreamReduce))
        for n, p in ((f"{m_name}.{k}", v) for k, v in m.named_parameters(recurse=False))
    }


@pytest.mark.parametrize("reduce", ["mean", "learned"])
@pytest.mark.parametrize("arch", ARCHS)
def test_from_pretrained_plain_checkpoint_gets_the_documented_init(arch, reduce, tmp_path):
    """MHCForCausalLM.from_pretrained(plain checkpoint, config=MHCConfig(...)) starts mHC as convert_to_mhc does."""
    base = tiny_base(arch)
    base.save_pretrained(tmp_path)
    x = ids()
    with torch.no_grad():
        ref = base(x).logits
    with empty_memory_is_nan():
        model, info = MHCForCausalLM.from_pretrained(
            tmp_path,
            config=MHCConfig(base_config=base.config, n_streams=4, reduce=reduce),
            output_loading_info=True,
        )
    fresh = mhc_parameters(model)
    assert fresh and all(k in info["missing_keys"] for k in fresh)  # "newly initialized", and now they are
    converted = mhc_parameters(convert_to_mhc(tiny_base(arch), n_streams=4, reduce=reduce))
    assert fresh.keys() == converted.keys()
    for name, p in fresh.items():
        assert p.dtype == torch.float32 and torch.equal(p, converted[name]), name
    with torch.no_grad():
        assert torch.equal(model.eval()(x).logits, ref)  # the base model's logits, bit for bit


def test_from_pretrained_plain_checkpoint_paper_init(tmp_path):
    base = tiny_base("llama")
    base.save_pretrained(tmp_path)
    with empty_memory_is_nan():
        model = MHCForCausalLM.from_pretrained(
            tmp_path, config=MHCConfig(base_config=base.config, init="paper")
        )
    for name, p in mhc_parameters(model).items():
        assert torch.isfinite(p).all(), name
    phi = model.model.model.layers[0].attn_mhc.phi
    assert 0.5 < phi.std().item() * phi.shape[1] ** 0.5 < 2  # drawn with std 1/sqrt(fan_in)
    with torch.no_grad():
        assert torch.isfinite(model(ids()).logits).all()


def test_loaded_mhc_parameters_are_not_reinitialised(tmp_path):
    model = convert_to_mhc(tiny_base("gpt2"), n_streams=4, reduce="learned", init="paper")
    perturb_mhc(model)
    with torch.no_grad():
        model.stream_reduce.weight.copy_(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    model.save_pretrained(tmp_path)
    x = ids()
    with torch.no_grad():
        out = model(x).logits
    with empty_memory_is_nan():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    saved = mhc_parameters(model)
    for name, p in mhc_parameters(loaded).items():
        assert torch.equal(p, saved[name]), name
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, out)


def edit_saved_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if key in config["base_config"]:
            config["base_config"][key] = value
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def test_config_with_more_layers_initialises_only_the_new_ones(tmp_path):
    model = convert_to_mhc(tiny_base("llama"), n_streams=4)
    perturb_mhc(model)
    model.save_pretrained(tmp_path)
    edit_saved_config(tmp_path, num_hidden_layers=3)
    with empty_memory_is_nan():
        loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    saved, got = mhc_parameters(model), mhc_parameters(loaded)
    new = {k for k in got if ".layers.2." in k}
    assert new and new <= info["missing_keys"] and got.keys() - new == saved.keys()
    for name in saved:
        assert torch.equal(got[name], saved[name]), name
    defaults = mhc_parameters(convert_to_mhc(tiny_base("llama", layers=3), n_streams=4))
    for name in new:
        assert torch.equal(got[name], defaults[name]), name
    with torch.no_grad():
        assert torch.isfinite(loaded(ids()).logits).all()


def test_config_switched_to_learned_reduce_starts_at_the_mean(tmp_path):
    model = convert_to_mhc(tiny_base("qwen3"), n_streams=4)
    perturb_mhc(model)
    model.save_pretrained(tmp_path)
    edit_saved_config(tmp_path, reduce="learned")
    with empty_memory_is_nan():
        loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {"stream_reduce.weight"}
    assert torch.equal(loaded.stream_reduce.weight, torch.full((4,), 0.25))
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x).logits, model(x).logits, rtol=1e-6, atol=1e-6)


def test_config_with_other_stream_count_raises_or_reinitialises(tmp_path):
    model = convert_to_mhc(tiny_base("llama"), n_streams=4, reduce="learned")
    perturb_mhc(model)
    for block in model.modules():
        if isinstance(block, MHCBlock):
            block.alpha.data.fill_(0.3)  # α has 3 entries for any n: it still loads
    model.save_pretrained(tmp_path)
    edit_saved_config(tmp_path, n_streams=2)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # the load report names the keys
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with empty_memory_is_nan():
        loaded, info = AutoModelForCausalLM.from_pretrained(
            tmp_path, ignore_mismatched_sizes=True, output_loading_info=True
        )
    got = mhc_parameters(loaded)
    resized = {k for k in got if not k.endswith(".alpha")}
    assert {k for k, *_ in info["mismatched_keys"]} == resized
    defaults = mhc_parameters(convert_to_mhc(tiny_base("llama"), n_streams=2, reduce="learned"))
    for name, p in got.items():
        assert torch.equal(p, defaults[name] if name in resized else torch.full((3,), 0.3)), name


# ----------------------------------------------------------------------------- one base config


def test_resize_token_embeddings_reaches_the_model_and_its_saved_config(tmp_path):
    """HF sets the new vocabulary on get_text_config(): that must be the base model's own config."""
    model = convert_to_mhc(tiny_base("llama"), n_streams=2).eval()
    assert model.config.get_text_config() is model.model.config
    model.resize_token_embeddings(120)
    assert model.config.vocab_size == model.model.config.vocab_size == 120
    assert model.config.base_config["vocab_size"] == 120
    x = torch.randint(100, 120, (2, 9))  # new token ids
    loss = model(x, labels=x).loss  # the base model's loss reads its config's vocabulary
    assert torch.isfinite(loss)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["base_config"]["vocab_size"] == 120
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_base_fields_set_on_the_config_reach_the_model():
    base = tiny_config("llama")
    cfg = MHCConfig(base_config=base, n_streams=2, hidden_size=48, rms_norm_eps=1e-4)
    assert (
        cfg.get_text_config().hidden_size == 48 and cfg.hidden_size == 48 and "hidden_size" not in vars(cfg)
    )
    model = MHCForCausalLM(cfg)
    assert model.get_input_embeddings().weight.shape[1] == 48
    assert model.model.config.rms_norm_eps == 1e-4
    model.config.use_cache = False  # the base model reads its own config
    assert model.model.config.use_cache is False
    assert model(ids()).past_key_values is None
    with pytest.raises(TypeError):  # a snapshot: set fields on the config, not in this view
        cfg.base_config["vocab_size"] = 7
    assert base.hidden_size == 32  # the caller's config is copied, not changed


def test_a_lite_config_with_too_many_streams_is_refused_when_built():
    with pytest.raises(ValueError, match="lite"):
        MHCConfig(base_config=tiny_config("llama"), n_streams=8, projection="lite")


def test_save_pretrained_saves_the_options_the_blocks_run(tmp_path):
    model = convert_to_mhc(tiny_base("llama"), n_streams=2, init="paper").eval()
    perturb_mhc(model)
    blocks = [m for m in model.modules() if isinstance(m, MHCBlock)]
    for b in blocks:
        b.projection, b.sinkhorn_iters = "sinkhorn", 2
    x = ids()
    with torch.no_grad():
        out = model(x).logits
    with pytest.warns(UserWarning, match="config.projection is 'newton', config.sinkhorn_iters is 20 but the "
                      "model's blocks run projection='sinkhorn', sinkhorn_iters=2"):  # fmt: skip
        model.save_pretrained(tmp_path / "a")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    assert {b.projection for b in loaded.modules() if isinstance(b, MHCBlock)} == {"sinkhorn"}
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, out)
    model.config.mode = "hc"  # read when a model is built: it changes nothing here, and is not saved
    with pytest.warns(UserWarning, match="config.mode is 'hc' but the model's blocks run mode='mhc'"):
        model.save_pretrained(tmp_path / "b")
    assert MHCConfig.from_pretrained(tmp_path / "b").mode == "mhc"
    blocks[0].sinkhorn_iters = 3
    with pytest.raises(ValueError, match="different options .*sinkhorn_iters: 2, 3"):
        model.save_pretrained(tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_an_adapter_whose_converted_model_does_not_run_is_a_conversion_error():
    """The self-check's run failing (here the MLP site calls the attention with the MLP's arguments) is
    reported as the adapter not fitting, with the cause chained, and the model is left unconverted."""
    import dataclasses

    from mhc.hf.adapters import Branch, Site
    from mhc.hf.verify import ConversionMismatchError

    llama = ADAPTERS["llama"]
    wrong = dataclasses.replace(
        llama, sites=(llama.sites[0], Site("mlp", (Branch("self_attn", norm="post_attention_layernorm"),)))
    )
    base = tiny_base("llama")
    with pytest.raises(ConversionMismatchError, match="the converted model does not run") as info:
        convert_to_mhc(base, n_streams=2, adapter=wrong)
    assert info.value.__cause__ is not None
    assert not any(type(m).__name__ == "MHCDecoderLayer" for m in base.modules())


def test_stability_report_under_inference_mode_says_why_it_needs_autograd():
    from mhc.diagnostics import stability_report

    model = convert_to_mhc(tiny_base("llama"), n_streams=2)
    x = ids()
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        stability_report(model, x, labels=x, loss_fn=lambda out: out.loss)
    with torch.inference_mode():
        assert stability_report(model, x).sites  # the forward measures need no autograd
