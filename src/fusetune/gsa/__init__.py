"""Gated slot attention: ``naive`` (the oracle), ``fused_recurrent`` and ``chunk`` kernels,
and the public :func:`gated_slot_attention` (``api``)."""

from fusetune.gsa.api import gated_slot_attention
from fusetune.gsa.naive import naive

__all__ = ["gated_slot_attention", "naive"]
