"""Linked sites: a site's post-mix that also serves the next site (:attr:`mhc.MHCBlock.next_site`).

:class:`mhc.MHCForCausalLM` links its sites in order (:meth:`mhc.MHCBlock.set_next_site`).
A link pays in two cases, both on the fused path:

* decoding (no grad, CUDA streams on :attr:`~mhc.fused.record.Backend.TOKENS`):
  the post-mix and the next site's first step run as one launch, with the bits
  of two separate calls;
* training with ``keep_streams_every = k > 1``: the next site keeps how to
  recompute its input streams in backward instead of the streams
  (:class:`mhc.fused.nodes.StreamsRecipe`), except at every k-th site.

What a site leaves for the next one waits in that site's :class:`SiteLink`
(its ``inbox``, a :class:`~mhc.fused.record.SiteLink`). The next site uses it only if it is called on this site's
output, unchanged (same tensor, same version counter); any other input runs
its own first step and keeps its own streams. Not under
``torch.inference_mode``, whose tensors keep no version counter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import site as _site
from .record import Backend, FusedSite, SiteLink

__all__ = ["post"]


def post(link: SiteLink, y: Tensor, site: FusedSite, keep_every: int) -> Tensor:
    """The post-mix of a site that may be linked: it serves the next block where it can (see the module docstring)."""
    if site.backend is Backend.TOKENS:
        if not torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            after = link.next_block()
            inputs = after.fused_first_step_inputs(site.streams) if after is not None else None
            if inputs is not None:  # decoding: this post-mix and the next block's first step in one launch
                params, norm_eps, tol, norm = inputs
                x_new, u_next, site_next = _site.post_then_pre(y, site, *params, norm_eps, tol, norm)
                after.site_link.inbox = (x_new, x_new._version, u_next, site_next)
                return x_new
    elif keep_every > 1 and site.backend is Backend.EAGER:
        # (Never under torch.compile: the link is a weak reference, which dynamo would not trace.)
        after = link.next_block()
        if after is not None:
            x_new, recipe = _site.post_recording(y, site, keep_every)
            if recipe is not None:
                after.site_link.inbox = (x_new, x_new._version, recipe)
            return x_new
    return _site.post(y, site)
