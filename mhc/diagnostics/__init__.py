"""Stability diagnostics: how the residual path ``H_res^{L-1} ⋯ H_res^0`` and the streams behave with depth.

Across sites the streams' residual path multiplies every site's ``H_res``
(``x_{l+1} = H_res^l x_l``, so the composite through site ``d`` is
``P_d = H_res^d ⋯ H_res^0``, later sites on the left). For mHC each factor is
doubly stochastic, so the composite is too: its max row and column sums stay 1
and its spectral norm at most 1. For HC the product is unconstrained and can
blow up. The mHC paper's "Amax gain magnitude" is the max absolute row sum
(forward gain) and the max absolute column sum (backward gain) of that composite.

* :mod:`~mhc.diagnostics.metrics`: the maths on tensors (gains, spread, saturation);
* :mod:`~mhc.diagnostics.collect`: hooks that record every site's coefficients and streams;
* :mod:`~mhc.diagnostics.report`: :class:`StabilityReport` per depth, its table and figure;
* ``python -m mhc.diagnostics MODEL_DIR``: the report of a saved model;
* :func:`mhc.testing.assert_composite_stable`: the same numbers as a test assertion.
"""

from .collect import SiteRecord, collect_h_res, collect_sites
from .metrics import (
    CompositeGains,
    TokenGains,
    backward_gain,
    composite_gains,
    composite_mapping,
    forward_gain,
    logit_scale,
    near_zero_or_one,
    one_hot_rows,
    stack_h_res,
    stream_spread,
    suffix_backward_gain,
    token_gains,
)
from .report import (
    DEFAULT_EPS,
    StabilityReport,
    plot_report,
    report_from_h_res,
    report_from_sites,
    stability_report,
)

__all__ = [
    "CompositeGains",
    "composite_mapping",
    "composite_gains",
    "collect_h_res",
    "TokenGains",
    "token_gains",
    "forward_gain",
    "backward_gain",
    "suffix_backward_gain",
    "stack_h_res",
    "stream_spread",
    "logit_scale",
    "near_zero_or_one",
    "one_hot_rows",
    "SiteRecord",
    "collect_sites",
    "DEFAULT_EPS",
    "StabilityReport",
    "stability_report",
    "report_from_h_res",
    "report_from_sites",
    "plot_report",
]
