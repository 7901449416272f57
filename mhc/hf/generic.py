"""The generic adapter: a decoder layer's residual layout, recognised from how its submodules are used.

For an architecture without a registered adapter, :func:`infer_adapter` runs
the model once on a short random input, with hooks on the first decoder
layer's direct submodules, and reads off the data flow:

* which submodules are norms (class name contains ``Norm``), dropouts
  (``nn.Dropout``) and sublayers (the rest; exactly two must run: the first
  is the attention, the second the MLP);
* for each sublayer, the norm whose output it reads (if any) and whether that
  norm read the layer input ``x`` or an intermediate state; the norm and
  dropout applied to its output (sandwich / post norms);
* parallel residual if the MLP's input comes from ``x`` as well, else
  sequential.

The layout is then checked by value on the recorded tensors: the
intermediate state must be ``x + attn`` (sequential) and the layer output
``x + attn + mlp`` (parallel) or ``h + mlp``, each within the dtype's
tolerance; the state must pass unchanged between layers and into one final
norm. Anything else (scaled residuals, three sublayers, a submodule whose
role is not one of these) raises :class:`UnsupportedLayoutError` saying what
does not fit. Tensors are matched by identity or by exact value: on random
weights two different tensors are never equal.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .adapters import ADAPTERS, Adapter, Branch, Site, registered_adapter, supported_model_types

__all__ = ["UnsupportedLayoutError", "infer_adapter", "adapter_for_model", "probe_input_ids"]

# |layout's output - layer's output| allowed, relative to max(1, max |layer output|): only the order of the
# residual additions differs between the two.
_REL_TOL = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


class UnsupportedLayoutError(ValueError):
    """The generic adapter does not fit a model; the message says which part does not."""


@dataclass
class _Call:
    order: int
    name: str
    kind: str  # "norm", "dropout" or "sublayer"
    inp: Tensor | None
    out: Tensor | None = None
    used: bool = False


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return False
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Dropout):
        return "dropout"
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "norm" in type(module).__name__.lower():
        return "norm"
    return "sublayer"


def find_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    candidates = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) == num_layers and len({type(x) for x in m}) == 1
    ]
    if not candidates:
        raise UnsupportedLayoutError(
            f"no nn.ModuleList of num_hidden_layers={num_layers} decoder layers of one class in {type(model).__name__}"
        )
    return max(candidates, key=lambda c: sum(p.numel() for p in c[1].parameters()))


class _Recorder:
    """Hooks that record the calls of one decoder layer's children, every layer's input/output, and outer norms."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList):
        self.counter = itertools.count()
        self.calls: list[_Call] = []
        self.layer_io: list[list[Tensor | None]] = [[None, None] for _ in layers]
        self.outer_norms: list[tuple[int, str, Tensor | None]] = []
        self.handles = []
        self.last_layer_order = -1
        for name, child in layers[0].named_children():
            self._hook_child(name, child)
        for i, layer in enumerate(layers):
            self._hook_layer(i, layer)
        inside = {id(m) for m in layers.modules()}
        for name, module in model.named_modules():
            if id(module) not in inside and name and _kind(module) == "norm":
                self._hook_outer_norm(name, module)

    def _hook_child(self, name: str, child: nn.Module) -> None:
        kind = _kind(child)
        pending: list[_Call] = []

        def pre(module, args, kwargs):
            inp = args[0] if args else kwargs.get("hidden_states")
            call = _Call(next(self.counter), name, kind, inp if isinstance(inp, Tensor) else None)
            self.calls.append(call)
            pending.append(call)

        def post(module, args, kwargs, output):
            pending.pop().out = _first_tensor(output)

        self.handles.append(child.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(child.register_forward_hook(post, with_kwargs=True))

    def _hook_layer(self, index: int, layer: nn.Module) -> None:
        def pre(module, args, kwargs):
            self.layer_io[index][0] = args[0] if args else kwargs.get("hidden_states")

        def post(module, args, output):
            self.layer_io[index][1] = _first_tensor(output)
            self.last_layer_order = next(self.counter)

        self.handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(layer.register_forward_hook(post))

    def _hook_outer_norm(self, name: str, module: nn.Module) -> None:
        def pre(module, args, kwargs):
            inp = args[0] if args else kwargs.get("hidden_states")
            self.outer_norms.append((next(self.counter), name, inp if isinstance(inp, Tensor) else None))

        self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _run_once(model: nn.Module, input_ids: Tensor) -> None:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        model.train(was_training)


def probe_input_ids(model: nn.Module, batch: int = 2, seq: int = 8, seed: int = 0) -> Tensor:
    """Random token ids ``[batch, seq]`` (int64, on the model's device) from a private generator."""
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


class _Layout:
    """Reads the recorded calls of the first decoder layer into branches and sites."""

    def __init__(self, calls: list[_Call], x: Tensor, out: Tensor, layer_name: str):
        self.calls, self.x, self.out, self.layer_name = calls, x, out, layer_name

    def fail(self, what: str) -> UnsupportedLayoutError:
        return UnsupportedLayoutError(f"the generic mHC adapter does not fit {self.layer_name}: {what}")

    def branch(self, call: _Call, layer_inputs: bool) -> tuple[Branch, Tensor, Tensor]:
        """The branch of sublayer ``call``, the tensor its input chain started from, and its output value."""
        call.used = True
        norm, start = None, call.inp
        producer = next(
            (c for c in reversed(self.calls[: self.calls.index(call)]) if _same(c.out, call.inp)), None
        )
        if producer is not None:
            if producer.kind != "norm":
                raise self.fail(
                    f"{call.name!r} reads the output of {producer.name!r} ({producer.kind}), not a norm's"
                )
            producer.used = True
            norm, start = producer.name, producer.inp
        post_norm = dropout = None
        value = call.out
        for later in self.calls[self.calls.index(call) + 1 :]:
            if later.used or not _same(later.inp, value):
                continue
            if later.kind == "norm" and post_norm is None and dropout is None:
                post_norm = later.name
            elif later.kind == "dropout" and dropout is None:
                dropout = later.name
            else:
                continue
            later.used = True
            value = later.out
        return (
            Branch(call.name, norm=norm, post_norm=post_norm, dropout=dropout, layer_inputs=layer_inputs),
            start,
            value,
        )

    def check_close(self, got: Tensor, want: Tensor, what: str) -> None:
        tol = _REL_TOL.get(want.dtype, 1e-5) * max(1.0, want.abs().max().item())
        diff = (got.float() - want.float()).abs().max().item()
        if diff > tol:
            raise self.fail(
                f"{what} (max |difference| {diff:.3g}, tolerance {tol:.3g}); a scaled residual "
                "(e.g. residual_multiplier) or a computation outside the sublayers needs its own adapter"
            )

    def sites(self) -> tuple[Site, ...]:
        sublayers = [c for c in self.calls if c.kind == "sublayer"]
        if len(sublayers) != 2 or sublayers[0].name == sublayers[1].name:
            raise self.fail(
                f"it calls the sublayers {[c.name for c in sublayers]}; the generic adapter knows "
                "one attention followed by one MLP (a submodule counts as a norm if its class name "
                "contains 'Norm', as a dropout if it is an nn.Dropout, else as a sublayer)"
            )
        attn_call, mlp_call = sublayers
        attn, attn_start, a = self.branch(attn_call, layer_inputs=True)
        if not _same(attn_start, self.x):
            raise self.fail(
                f"the attention {attn_call.name!r} does not read the layer input (or a norm of it)"
            )
        mlp, mlp_start, m = self.branch(mlp_call, layer_inputs=False)
        for name, value in ((attn_call.name, a), (mlp_call.name, m), ("the MLP's input", mlp_start)):
            if tuple(value.shape) != tuple(self.x.shape):
                raise self.fail(
                    f"{name!r} has shape {tuple(value.shape)}, the layer input {tuple(self.x.shape)} (a "
                    "sublayer that flattens the tokens, as some mixtures of experts do, needs its own adapter)"
                )
        if _same(mlp_start, self.x):  # parallel residual: both read x
            self.check_close(self.x + a + m, self.out, "its output is not x + attn + mlp")
            sites = (Site("parallel", (attn, mlp)),)
        else:
            self.check_close(
                mlp_start, self.x + a, "the MLP's input is neither x (parallel) nor x + attn (sequential)"
            )
            self.check_close(mlp_start + m, self.out, "its output is not h + mlp with h = x + attn")
            sites = (Site("attn", (attn,)), Site("mlp", (mlp,)))
        unused = [c.name for c in self.calls if not c.used]
        if unused:
            raise self.fail(
                f"submodule(s) {unused} run, but not as a norm, post-norm or dropout of the attention "
                "or the MLP"
            )
        return sites


def infer_adapter(model: nn.Module, input_ids: Tensor | None = None) -> Adapter:
    """The adapter of a ``*ForCausalLM`` read from one forward pass (see the module docstring).

    Args:
        model: a transformers causal LM with real weights (not on the meta device).
        input_ids: ``[B, S]`` int64 ids to run; default :func:`probe_input_ids`.

    Raises:
        UnsupportedLayoutError: (a ``ValueError``) naming what does not fit.
    """
    text_config = model.config.get_text_config()
    num_layers = getattr(text_config, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise UnsupportedLayoutError(f"{type(model).__name__}'s config has no num_hidden_layers")
    if any(p.is_meta for p in model.parameters()):
        raise UnsupportedLayoutError(
            "the generic adapter runs the model once, and this one has weights on 'meta'"
        )
    layers_path, layers = find_layers(model, num_layers)
    recorder = _Recorder(model, layers)
    try:
        _run_once(model, probe_input_ids(model) if input_ids is None else input_ids)
    finally:
        recorder.remove()

    layer_name = type(layers[0]).__name__
    io = recorder.layer_io
    if any(t is None for pair in io for t in pair):
        raise UnsupportedLayoutError(
            f"not every {layer_name} in {layers_path!r} ran on a hidden-state tensor"
        )
    for i in range(num_layers - 1):
        if not _same(io[i][1], io[i + 1][0]):
            raise UnsupportedLayoutError(
                f"the model changes the hidden state between decoder layers {i} and {i + 1}"
            )
    sites = _Layout(recorder.calls, io[0][0], io[0][1], layer_name).sites()
    # What the layer holds outside the modules the sites use would be dropped without a word: a learned
    # residual scale that happens to equal 1 (Doge's, at init) passes the check by value above.
    used = {name for site in sites for branch in site.branches for name in branch.module_names()}
    left = [name for name, _ in layers[0].named_parameters(recurse=False)]
    left += [
        name
        for name, child in layers[0].named_children()
        if name not in used and next(child.parameters(), None) is not None
    ]
    if left:
        raise UnsupportedLayoutError(
            f"{layer_name} holds parameters outside the sublayers and norms the generic adapter uses: "
            f"{', '.join(sorted(left))} (e.g. a learned residual scale); they would take no part after "
            "conversion, so it needs its own adapter"
        )

    last = io[-1][1]
    after = [
        (order, name)
        for order, name, inp in recorder.outer_norms
        if order > recorder.last_layer_order and _same(inp, last)
    ]
    if not after:
        raise UnsupportedLayoutError(f"no norm outside the layers reads the last {layer_name}'s output")
    return Adapter(layers=layers_path, final_norm=min(after)[1], sites=sites)


def adapter_for_model(model: nn.Module) -> Adapter:
    """The adapter :func:`mhc.convert_to_mhc` uses for ``model``: the registered one of its
    ``model_type``, else the generic adapter's reading of it (:func:`infer_adapter`).

    Raises:
        ValueError: neither fits; the message says what in the model does not fit the generic adapter.
    """
    adapter = registered_adapter(model.config)
    if adapter is not None:
        return adapter
    try:
        return infer_adapter(model)
    except UnsupportedLayoutError as err:
        raise UnsupportedLayoutError(
            f"mHC has no adapter for architecture {model.config.model_type!r} (registered: "
            f"{', '.join(supported_model_types())}), and {err}. Register one with "
            "mhc.hf.adapters.register_adapter(model_type, Adapter(...))."
        ) from None


def _adapter_owners(adapter: Adapter) -> list[str]:
    """The model types whose registered adapter is ``adapter`` (those registered as a fixed :class:`Adapter`)."""
    return sorted(t for t, spec in ADAPTERS.items() if isinstance(spec, Adapter) and spec == adapter)


def check_adapter_fits(model: nn.Module, adapter: Adapter) -> None:
    """Raise ``ValueError`` if ``adapter`` names modules that ``model`` (a base ``*ForCausalLM``) does not have.

    Checked: the decoder-layer list (``adapter.layers``), the final norm and, in the first
    layer, every submodule a site names. The message says which base ``model_type`` and which
    adapter disagree (the model types that registered it), where the model keeps its decoder
    layers, and how to fix it: an :class:`MHCConfig` whose ``base_config`` and ``adapter`` come
    from different models (a GPT-2 config with Llama's adapter) builds with ``adapter=None``,
    which takes the adapter registered for its base ``model_type``.
    """
    problem = None
    try:
        layers = model.get_submodule(adapter.layers)
    except AttributeError:
        problem = f"has no {adapter.layers!r} (where the adapter looks for the decoder layers)"
    else:
        if not isinstance(layers, nn.ModuleList):
            problem = f"has a {type(layers).__name__} at {adapter.layers!r}, not the nn.ModuleList of decoder layers"
        else:
            try:
                model.get_submodule(adapter.final_norm)
            except AttributeError:
                problem = f"has no {adapter.final_norm!r} (the adapter's final norm)"
            if problem is None and len(layers):
                names = [n for site in adapter.sites for b in site.branches for n in b.module_names()]
                missing = [
                    n for n in dict.fromkeys(names) if not isinstance(getattr(layers[0], n, None), nn.Module)
                ]
                if missing:
                    problem = (
                        f"has decoder layers ({type(layers[0]).__name__}) with no submodule "
                        f"{', '.join(map(repr, missing))} (which the adapter's sites use)"
                    )
    if problem is None:
        return
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    what = f"{type(model).__name__} (base model_type {model_type!r})"
    where = ""
    num_layers = getattr(config, "num_hidden_layers", None)
    if isinstance(num_layers, int) and num_layers > 0:
        try:
            found, _ = find_layers(model, num_layers)
            where = f"; its {num_layers} decoder layers are at {found!r}"
        except UnsupportedLayoutError:
            pass
    owners = _adapter_owners(adapter)
    whose = f"the adapter registered for {', '.join(map(repr, owners))}" if owners else "a custom adapter"
    own = registered_adapter(config) if config is not None else None
    fix = (
        f"use the adapter registered for {model_type!r} instead (MHCConfig(..., adapter=None), or "
        "convert_to_mhc without adapter=)"
        if own is not None
        else "pass an adapter that describes this model (convert_to_mhc(model) infers one for architectures "
        "without a registered adapter)"
    )
    raise ValueError(
        f"the mHC adapter does not fit {what}: the model {problem}{where}. The adapter (layers at "
        f"{adapter.layers!r}) is {whose}: it was made for another architecture than the base model's. "
        f"To fix it, {fix}, or build the model from the base config the adapter was recorded with."
    )
