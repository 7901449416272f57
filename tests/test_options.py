"""Options of MHCBlock, MHCOptions, MHCConfig and convert_to_mhc: misspelt or ill-typed ones raise, naming the option."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from test_hf import tiny_base, tiny_config
from torch import nn
from transformers import AutoConfig

from mhc import MHCBlock, MHCConfig, MHCForCausalLM, MHCOptions, convert_to_mhc
from mhc.options import check_options

C = 8

# (option, bad value, error type), valid for MHCBlock and MHCConfig alike.
BAD_VALUES = [
    ("n_streams", 2.7, TypeError),
    ("n_streams", True, TypeError),
    ("n_streams", "4", TypeError),
    ("n_streams", 0, ValueError),
    ("tol", 0.0, ValueError),
    ("tol", -1e-6, ValueError),
    ("tol", math.nan, ValueError),
    ("tol", math.inf, ValueError),
    ("tol", "1e-6", TypeError),
    ("tol", True, TypeError),
    ("sinkhorn_iters", 0, ValueError),
    ("sinkhorn_iters", 2.5, TypeError),
    ("sinkhorn_iters", False, TypeError),
    ("norm_eps", 0.0, ValueError),
    ("norm_eps", math.inf, ValueError),
    ("alpha_init", math.nan, ValueError),
    ("alpha_init", True, TypeError),
    ("fused", 1, TypeError),
    ("recompute", "yes", TypeError),
    ("keep_streams_every", 0, ValueError),
    ("keep_streams_every", 2.0, TypeError),
    ("keep_streams_every", True, TypeError),
    ("mode", "mch", ValueError),
    ("init", "zeros", ValueError),
    ("projection", "Newton", ValueError),
]


def block(**options) -> MHCBlock:
    return MHCBlock(nn.Linear(C, C), C, **options)


@pytest.mark.parametrize("name, value, error", BAD_VALUES)
def test_block_rejects_bad_values(name, value, error):
    with pytest.raises(error, match=name):
        block(**{name: value})


@pytest.mark.parametrize("name, value, error", BAD_VALUES)
def test_config_rejects_bad_values(name, value, error):
    with pytest.raises(error, match=name):
        MHCConfig(base_config=tiny_config("llama"), **{name: value})


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(hidden_size=8.0), TypeError),
        (dict(hidden_size=True), TypeError),
        (dict(hidden_size=0), ValueError),
        (dict(layer_index=-1), ValueError),
        (dict(layer_index=1.0), TypeError),
    ],
)
def test_block_rejects_bad_sizes(kwargs, error):
    name = next(iter(kwargs))
    args = dict(hidden_size=C, layer_index=0) | kwargs
    with pytest.raises(error, match=name):
        MHCBlock(nn.Identity(), args.pop("hidden_size"), 4, **args)


def test_numbers_are_normalised():
    """Integral and real numbers of other types (numpy's, ints for reals) are accepted and stored as int/float."""
    b = block(n_streams=np.int64(3), tol=1, alpha_init=0, norm_eps=1)
    assert type(b.n_streams) is int and b.n_streams == 3
    assert type(b.tol) is float and type(b.alpha_init) is float and type(b.norm_eps) is float
    cfg = MHCConfig(base_config=tiny_config("llama"), n_streams=np.int64(2), tol=np.float32(1e-5))
    assert type(cfg.n_streams) is int and cfg.n_streams == 2 and type(cfg.tol) is float


@pytest.mark.parametrize(
    "typo, meant",
    [
        ("projecton", "projection"),
        ("n_stream", "n_streams"),
        ("sinkhorn_iter", "sinkhorn_iters"),
        ("Mode", "mode"),
    ],
)
def test_misspelt_options_raise_with_the_close_match(typo, meant):
    with pytest.raises(TypeError, match=f"{typo}.*did you mean '{meant}'"):
        block(**{typo: "sinkhorn"})
    with pytest.raises(TypeError, match=f"{typo}.*did you mean '{meant}'"):
        MHCConfig(base_config=tiny_config("llama"), **{typo: "sinkhorn"})
    with pytest.raises(TypeError, match=f"{typo}.*did you mean '{meant}'"):
        convert_to_mhc(tiny_base("llama"), **{typo: "sinkhorn"})


def test_misspelt_projection_no_longer_runs_newton():
    """The user's case: convert_to_mhc(model, projecton="sinkhorn") used to build Newton blocks."""
    with pytest.raises(TypeError, match="projection"):
        convert_to_mhc(tiny_base("llama"), projecton="sinkhorn")
    model = convert_to_mhc(tiny_base("llama"), projection="sinkhorn")
    assert {m.projection for m in model.modules() if isinstance(m, MHCBlock)} == {"sinkhorn"}


def test_convert_to_mhc_takes_only_mhc_options():
    for name, value in [
        ("output_hidden_states", True),
        ("bos_token_id", 1),
        ("base_config", {}),
        ("hidden_size", 64),
    ]:
        with pytest.raises(TypeError, match=name):
            convert_to_mhc(tiny_base("llama"), **{name: value})
    model = convert_to_mhc(
        tiny_base("llama"),
        n_streams=2,
        mode="hc",
        init="paper",
        tol=1e-5,
        reduce="learned",
        sinkhorn_iters=5,
        fused=False,
        recompute=True,
        alpha_init=0.1,
        norm_eps=1e-5,
        expand="copy",
    )
    blocks = [m for m in model.modules() if isinstance(m, MHCBlock)]
    assert all(b.n_streams == 2 and b.mode == "hc" and b.recompute and b.sinkhorn_iters == 5 for b in blocks)


def test_config_keeps_accepting_pretrained_config_keywords(tmp_path):
    """What HF itself passes when loading (and users set) must not trip the misspelling check."""
    standard = dict(
        torch_dtype="float32",
        dtype="float32",
        architectures=["MHCForCausalLM"],
        transformers_version="5.0.0",
        _name_or_path="somewhere",
        name_or_path="somewhere",
        output_hidden_states=False,
        output_attentions=False,
        return_dict=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        use_cache=True,
        tie_word_embeddings=False,
        _attn_implementation="eager",
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        is_encoder_decoder=False,
        chunk_size_feed_forward=0,
        problem_type=None,
        id2label=None,
        label2id=None,
        my_own_note="kept as an attribute",
    )
    cfg = MHCConfig(base_config=tiny_config("llama"), **standard)
    assert cfg.my_own_note == "kept as an attribute" and cfg.bos_token_id == 1
    MHCForCausalLM(MHCConfig(base_config=tiny_config("llama"), n_streams=2)).save_pretrained(tmp_path)
    again = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(again, MHCConfig) and again.n_streams == 2


def test_config_checks_expand_and_reduce():
    with pytest.raises(ValueError, match="reduce"):
        MHCConfig(base_config=tiny_config("llama"), reduce="sum")
    with pytest.raises(ValueError, match="expand"):
        MHCConfig(base_config=tiny_config("llama"), expand="zeros")
    with pytest.raises(TypeError, match="did you mean 'reduce'"):
        MHCConfig(base_config=tiny_config("llama"), reduse="learned")


def test_reset_parameters_names_are_checked():
    b = block(init="paper")
    with pytest.raises(TypeError, match="'ph'.*did you mean 'phi'"):
        b.reset_parameters(["ph"])
    phi, b_pre = b.phi.detach().clone(), b.b_pre.detach().clone()
    with torch.no_grad():
        b.b_pre.add_(1.0)
    b.reset_parameters(["b_pre"])  # only b_pre goes back to its init; phi keeps its (random) draw
    assert torch.equal(b.b_pre, b_pre) and torch.equal(b.phi, phi)


OPTION_BAD_VALUES = [(name, value, error) for name, value, error in BAD_VALUES if name in MHCOptions.fields()]


def test_options_fields_are_the_site_settings():
    assert MHCOptions.fields() == (
        "mode",
        "init",
        "projection",
        "tol",
        "sinkhorn_iters",
        "fused",
        "recompute",
        "keep_streams_every",
        "alpha_init",
        "norm_eps",
    )
    defaults = MHCOptions().to_dict()
    assert defaults == dict(
        mode="mhc",
        init="identity",
        projection="newton",
        tol=1e-6,
        sinkhorn_iters=20,
        fused=True,
        recompute=False,
        keep_streams_every=1,
        alpha_init=0.01,
        norm_eps=1e-6,
    )
    assert json.loads(json.dumps(defaults)) == defaults  # plain values


@pytest.mark.parametrize("name, value, error", OPTION_BAD_VALUES)
def test_options_reject_bad_values(name, value, error):
    with pytest.raises(error, match=name):
        MHCOptions(**{name: value})
    with pytest.raises(error, match=name):
        MHCOptions.from_dict({name: value})
    with pytest.raises(error, match=name):
        MHCOptions().replace(**{name: value})


def test_options_from_dict_round_trip_and_normalise():
    opts = MHCOptions.from_dict({"tol": np.float32(1e-5), "sinkhorn_iters": np.int64(7), "mode": "hc"})
    assert type(opts.tol) is float and type(opts.sinkhorn_iters) is int
    assert opts.mode == "hc" and opts.init == "identity"  # the rest keep their defaults
    assert MHCOptions.from_dict(opts.to_dict()) == opts
    assert opts.replace(recompute=True) == MHCOptions(**{**opts.to_dict(), "recompute": True})
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.tol = 1.0


@pytest.mark.parametrize(
    "typo, meant", [("tool", "tol"), ("Fused", "fused"), ("sinkhorn_iter", "sinkhorn_iters")]
)
def test_options_unknown_keys_raise_with_the_close_match(typo, meant):
    with pytest.raises(TypeError, match=f"{typo}.*did you mean '{meant}'"):
        MHCOptions.from_dict({typo: 1})
    with pytest.raises(TypeError, match=f"{typo}.*did you mean '{meant}'"):
        MHCOptions().replace(**{typo: 1})
    with pytest.raises(TypeError, match="mapping"):
        MHCOptions.from_dict([("tol", 1e-5)])


def test_block_takes_options_and_keywords():
    opts = MHCOptions(mode="hc", tol=1e-5, recompute=True)
    b = MHCBlock(nn.Linear(C, C), C, 2, options=opts)
    assert b.options == opts and b.mode == "hc" and b.tol == 1e-5 and b.recompute
    # Keywords override the options object's fields.
    b = MHCBlock(nn.Linear(C, C), C, 2, options=opts, recompute=False, init="paper")
    assert b.options == opts.replace(recompute=False, init="paper")
    assert MHCBlock(nn.Linear(C, C), C, 2, sinkhorn_iters=3).options == MHCOptions(sinkhorn_iters=3)
    with pytest.raises(TypeError, match="options must be an MHCOptions"):
        MHCBlock(nn.Linear(C, C), C, 2, options={"mode": "hc"})


def test_block_option_attributes_are_checked_when_set():
    b = block()
    b.fused = False
    b.tol = 1e-4
    assert b.options == MHCOptions(fused=False, tol=1e-4)
    with pytest.raises(TypeError, match="fused"):
        b.fused = 1
    with pytest.raises(ValueError, match="tol"):
        b.tol = -1.0
    assert b.options == MHCOptions(fused=False, tol=1e-4)  # unchanged by the refused values
    with pytest.raises(ValueError, match="mode is fixed"):
        b.mode = "hc"
    with pytest.raises(ValueError, match="mode is fixed"):
        b.options = MHCOptions(mode="residual")
    b.options = MHCOptions(projection="sinkhorn")
    assert b.projection == "sinkhorn"
    with pytest.raises(TypeError, match="options must be an MHCOptions"):
        b.options = {"projection": "newton"}


def test_config_options_are_what_its_blocks_run_by():
    cfg = MHCConfig(
        base_config=tiny_config("llama"), n_streams=2, mode="hc", tol=1e-5, recompute=True, fused=False
    )
    opts = cfg.options()
    assert opts == MHCOptions(mode="hc", tol=1e-5, recompute=True, fused=False)
    assert {
        k: getattr(cfg, k) for k in MHCOptions.fields()
    } == opts.to_dict()  # plain fields, as config.json holds
    model = MHCForCausalLM(cfg)
    blocks = [m for m in model.modules() if isinstance(m, MHCBlock)]
    assert blocks and all(b.options == opts and b.n_streams == 2 for b in blocks)
    with pytest.raises(TypeError, match="tol"):  # a field set on the config is checked at once
        cfg.tol = "small"
    with pytest.raises(ValueError, match="reduce must be 'mean' or 'learned'"):
        cfg.reduce = "max"
    cfg.tol = 1e-4
    assert cfg.options().tol == 1e-4
    cfg.__dict__["tol"] = "small"  # a value that slipped past the check: options() checks again
    with pytest.raises(TypeError, match="tol"):
        cfg.options()


def test_projection_choices_include_the_variants_and_refuse_misspellings():
    assert MHCOptions(projection="lite").projection == "lite"
    assert MHCOptions(projection="sinkhorn").projection == "sinkhorn"
    for typo in ("lit", "Lite", "permutations", "sinkhorn20", "Newton"):
        with pytest.raises(ValueError, match=f"projection must be one of .*'lite'.*got '{typo}'"):
            MHCOptions(projection=typo)
    # The block's own epsilons go through the same check, by name.
    with pytest.raises(ValueError, match="pre_eps must be finite and >= 0"):
        check_options(pre_eps=-1.0)
    with pytest.raises(TypeError, match="sinkhorn_eps must be a real number"):
        check_options(sinkhorn_eps=True)
    assert check_options(pre_eps=0, sinkhorn_eps=1e-6) == {"pre_eps": 0.0, "sinkhorn_eps": 1e-6}
    # They are not MHCOptions fields (MHCConfig does not store them).
    with pytest.raises(TypeError, match="unknown option 'pre_eps'"):
        MHCOptions.from_dict({"pre_eps": 0.0})
