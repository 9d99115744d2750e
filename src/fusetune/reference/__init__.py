"""Pure-PyTorch twins of every fusetune op: same signatures, same semantics, obviously right.

They are the CPU path of the public ops and the oracle the tests compare the kernels with."""

from fusetune.reference.activation import geglu, swiglu
from fusetune.reference.causal_conv1d import causal_conv1d
from fusetune.reference.cross_entropy import cross_entropy
from fusetune.reference.gated_delta_rule import gated_delta_rule
from fusetune.reference.glu_linear import glu_linear
from fusetune.reference.grpo import grpo_loss, selective_log_softmax
from fusetune.reference.gsa import gated_slot_attention
from fusetune.reference.linear_cross_entropy import linear_cross_entropy
from fusetune.reference.moe import MoeLora, moe_mlp
from fusetune.reference.rms_norm import add_rms_norm, rms_norm, rms_norm_gated
from fusetune.reference.rope import rope

__all__ = [
    "MoeLora",
    "add_rms_norm",
    "causal_conv1d",
    "cross_entropy",
    "gated_delta_rule",
    "gated_slot_attention",
    "geglu",
    "glu_linear",
    "grpo_loss",
    "linear_cross_entropy",
    "moe_mlp",
    "rms_norm",
    "rms_norm_gated",
    "rope",
    "selective_log_softmax",
    "swiglu",
]
