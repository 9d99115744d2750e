"""Chunked GSA kernels (in progress)."""

from fusetune.gsa.fused_recurrent import bwd_a_kernel, bwd_b_kernel, fwd_kernel  # noqa: F401


def constants(seq_len: int, interpreting: bool) -> dict:
    raise NotImplementedError("gated_slot_attention(mode='chunk') is not available yet; "
                              "use mode='recurrent'")
