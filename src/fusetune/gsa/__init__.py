"""Gated slot attention, kept as a thin re-export so that existing imports keep working.

Where things live now (the layout every op follows):
- ``fusetune.ops.linear_attention.gsa``: :func:`gated_slot_attention` (checks, dispatch, custom
  ops, autograd, the backward's math); kernels in ``gsa_chunk`` (mode="chunk") and
  ``gsa_recurrent`` (mode="recurrent"), helpers shared with the gated delta rule in ``_common``.
- ``fusetune.reference.gsa``: the float64-capable oracle (exported here as ``naive``, its old
  name) and the argument checks.
"""

from fusetune.ops.linear_attention.gsa import gated_slot_attention
from fusetune.reference.gsa import gated_slot_attention as naive

__all__ = ["gated_slot_attention", "naive"]
