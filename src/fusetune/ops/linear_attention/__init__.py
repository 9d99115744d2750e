"""Linear attention: chunked and recurrent kernels of gated recurrences with a matrix state.

Today: the gated delta rule (Gated DeltaNet, Qwen3.5 / Qwen3-Next). Gated slot attention still
lives in ``fusetune.gsa`` and moves here later, sharing ``_common``.
"""

from fusetune.ops.linear_attention.gated_delta_rule import gated_delta_rule

__all__ = ["gated_delta_rule"]
