"""Test helpers: assert that a model's residual path is stable, with a readable report when it is not.

::

    from mhc.testing import assert_composite_stable

    def test_my_model_stays_stable():
        assert_composite_stable(model, input_ids)                       # exact mHC: the defaults
        assert_composite_stable(hc_model, x, max_gain=10.0, max_marginal_error=None)   # HC: say what you accept

The gains are those of :mod:`mhc.diagnostics`: for the prefix composite
``P_d = H_res^d ⋯ H_res^0`` (``x_{l+1} = H_res^l x_l``, later sites on the left),
the forward gain is the max absolute row sum and the backward gain the max
absolute column sum, per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor, nn

from .diagnostics import StabilityReport, report_from_h_res, stability_report

__all__ = ["DEFAULT_MAX_MARGINAL_ERROR", "assert_composite_stable"]

#: Largest accepted doubly-stochastic deviation (:func:`mhc.marginal_error`) of one site's ``H_res``.
#: Newton's projection reaches ~2e-6 (n = 4) to ~4e-6 (n = 8) in float32; 20 Sinkhorn steps do not always.
DEFAULT_MAX_MARGINAL_ERROR = 1e-4

# Rows of the per-depth excerpt in a failure message when the model is deeper than this.
_FULL_TABLE_UP_TO = 24


def _check_limit(name: str, value, *, allow_zero: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number or None, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _site(report: StabilityReport, d: int) -> str:
    return f"depth {d} (site {report.sites[d]!r})"


def _token(token: tuple[int, ...]) -> str:
    return f"token {token}" if token else "the only token"  # () for unbatched [n, n] H_res


def _beyond(value: float, limit: float) -> str:
    """``value`` with enough digits to show it is past ``limit`` (``1+1.2e-07`` against a limit of 1)."""
    text = f"{value:.6g}"
    if math.isfinite(value) and float(text) <= limit:
        text = f"{limit:.6g}+{value - limit:.2g}"
    return text


def _gain_problem(
    report: StabilityReport, what: str, maxima: list[float], tokens: list, limit: float
) -> str | None:
    over = [d for d, v in enumerate(maxima) if not v <= limit]  # NaN is over
    if not over:
        return None
    worst = max(over, key=lambda d: math.inf if math.isnan(maxima[d]) else maxima[d])
    return (
        f"{what} gain {_beyond(maxima[worst], limit)} > max_gain {limit:.6g}: worst at {_site(report, worst)}, "
        f"{_token(tokens[worst])}; over the limit from {_site(report, over[0])} on, at {len(over)} of {report.depth} depths"
    )


def _excerpt(report: StabilityReport, depths: set[int]) -> str:
    rows = sorted(depths) if report.depth > _FULL_TABLE_UP_TO else range(report.depth)
    width = max(4, *(len(report.sites[d]) for d in rows))
    out = [
        f"{'depth':>5}  {'site':<{width}}  {'fwd gain max':>13}  {'bwd gain max':>13}  {'marginal error':>14}"
    ]
    for d in rows:
        out.append(
            f"{d:>5}  {report.sites[d]:<{width}}  {report.forward_gain_max[d]:>13.6g}  "
            f"{report.backward_gain_max[d]:>13.6g}  {report.marginal_error_max[d]:>14.3e}"
        )
    return "\n".join(out)


def assert_composite_stable(
    model: nn.Module | Sequence[Tensor] | Tensor,
    *inputs,
    max_gain: float | None = None,
    max_marginal_error: float | None = DEFAULT_MAX_MARGINAL_ERROR,
    model_kwargs: dict | None = None,
) -> StabilityReport:
    """Assert that every site's composite mapping keeps its gains and marginals within limits.

    Runs ``model(*inputs, **model_kwargs)`` (under ``no_grad``), collects every
    :class:`~mhc.MHCBlock`'s ``H_res`` per token in the order the sites ran, and checks at
    every depth ``d`` and every token:

    * the forward gain (max absolute row sum) and backward gain (max absolute column
      sum) of ``P_d = H_res^d ⋯ H_res^0`` are at most ``max_gain``;
    * each site's own ``H_res`` has :func:`mhc.marginal_error` at most ``max_marginal_error``;
    * every ``H_res`` entry is finite (a NaN gain is over any limit).

    Args:
        model: an :class:`~mhc.MHCForCausalLM`, any ``nn.Module`` holding ``MHCBlock`` s, or the
            per-site ``H_res`` themselves (a list of ``[*batch, n, n]`` tensors or one
            ``[L, *batch, n, n]`` tensor, first site first; then give no inputs).
        *inputs: the model's positional inputs (e.g. ``input_ids``).
        max_gain: the largest accepted gain. None (default): ``(1 + max_marginal_error) ** L``
            for ``L`` sites, the most a product of ``L`` non-negative matrices whose row and
            column sums are within ``max_marginal_error`` of 1 can reach. Give it for HC.
        max_marginal_error: the largest accepted marginal error of one site's ``H_res``
            (default :data:`DEFAULT_MAX_MARGINAL_ERROR`, for exact mHC); None skips the check
            (HC has no doubly-stochastic constraint; give a value for Sinkhorn variants).
        model_kwargs: keyword inputs of the model (e.g. ``{"use_cache": False}``).

    Returns:
        The :class:`~mhc.diagnostics.StabilityReport` that passed.

    Raises:
        AssertionError: a limit is broken; the message names each broken limit with its worst
            depth, site and token, where it was first broken, and a per-depth excerpt.
        TypeError, ValueError: bad arguments (an unknown limit, ``max_gain=None`` with
            ``max_marginal_error=None``, inputs given with bare ``H_res``, a model without sites).
    """
    max_gain = _check_limit("max_gain", max_gain, allow_zero=False)
    max_marginal_error = _check_limit("max_marginal_error", max_marginal_error, allow_zero=True)
    if max_gain is None and max_marginal_error is None:
        raise ValueError(
            "give max_gain when max_marginal_error is None (the default max_gain derives from it)"
        )
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise TypeError(f"model_kwargs must be a dict, got {type(model_kwargs).__name__}")
    if isinstance(model, nn.Module):
        report = stability_report(model, *inputs, **(model_kwargs or {}))
    elif isinstance(model, (Tensor, list, tuple)):
        if inputs or model_kwargs:
            raise TypeError("assert_composite_stable: inputs are for a model; bare H_res tensors take none")
        report = report_from_h_res(model)
    else:
        raise TypeError(f"model must be an nn.Module or H_res tensors, got {type(model).__name__}")

    limit = max_gain if max_gain is not None else (1 + max_marginal_error) ** report.depth
    problems, depths = [], {0, report.depth - 1}
    for what, maxima, tokens in (
        ("forward", report.forward_gain_max, report.forward_gain_token),
        ("backward", report.backward_gain_max, report.backward_gain_token),
    ):
        problem = _gain_problem(report, what, maxima, tokens, limit)
        if problem:
            problems.append(problem)
            over = [d for d, v in enumerate(maxima) if not v <= limit]
            depths.update(
                (over[0], max(over, key=lambda d: maxima[d] if not math.isnan(maxima[d]) else math.inf))
            )
    if max_marginal_error is not None:
        errors = report.marginal_error_max
        over = [d for d, v in enumerate(errors) if not v <= max_marginal_error]
        if over:
            worst = max(over, key=lambda d: math.inf if math.isnan(errors[d]) else errors[d])
            problems.append(
                f"marginal error {errors[worst]:.3e} > max_marginal_error {max_marginal_error:.3g}: worst at "
                f"{_site(report, worst)}, {_token(report.marginal_error_token[worst])}; {len(over)} of "
                f"{report.depth} sites over the limit (first: {_site(report, over[0])})"
            )
            depths.update((over[0], worst))
    if problems:
        tokens = math.prod(report.batch_shape)
        how = "given" if max_gain is not None else f"(1 + max_marginal_error) ** {report.depth}"
        raise AssertionError(
            f"composite mapping not stable over {report.depth} sites and {tokens} tokens "
            f"(max_gain {limit:.6g}, {how}):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nper depth (max over tokens):\n"
            + _excerpt(report, depths)
        )
    return report
