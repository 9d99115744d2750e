"""torch.nn.Module wrappers of fusetune's ops."""

from fusetune.nn.gsa import GatedSlotAttention
from fusetune.nn.loss import CrossEntropyLoss, GRPOLoss, LinearCrossEntropyLoss
from fusetune.nn.mlp import GatedMLP, GeGLUMLP, SwiGLUMLP
from fusetune.nn.norm import RMSNorm, RMSNormGated
from fusetune.nn.rope import RotaryEmbedding

__all__ = [
    "CrossEntropyLoss",
    "GatedMLP",
    "GatedSlotAttention",
    "GRPOLoss",
    "GeGLUMLP",
    "LinearCrossEntropyLoss",
    "RMSNorm",
    "RMSNormGated",
    "RotaryEmbedding",
    "SwiGLUMLP",
]
