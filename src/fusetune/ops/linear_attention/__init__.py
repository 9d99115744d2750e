"""Linear attention: chunked and recurrent kernels of gated recurrences with a matrix state.

The gated delta rule (Gated DeltaNet, Qwen3.5 / Qwen3-Next: ``gated_delta_rule``, ``gdr_chunk``,
``gdr_recurrent``) and gated slot attention (``gsa``, ``gsa_chunk``, ``gsa_recurrent``), sharing
``_common``; their float64 oracles are in ``fusetune.reference``.
"""

from fusetune.ops.linear_attention.gated_delta_rule import gated_delta_rule
from fusetune.ops.linear_attention.gsa import gated_slot_attention

__all__ = ["gated_delta_rule", "gated_slot_attention"]
