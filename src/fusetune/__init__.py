"""fusetune: exact, fast Triton kernels for fine-tuning and RL-training LLMs.

Set ``FUSETUNE_INTERPRET=1`` before importing (before torch, which may import triton) to run
the Triton kernels on CPU tensors through Triton's interpreter.
"""

from fusetune import (
    _env,  # noqa: F401  (must run before anything imports triton)
    gsa,
    nn,
    reference,
)
from fusetune._utils import backend
from fusetune.graphed_step import graph_train_step
from fusetune.integrations.transformers import apply, compile_layers, revert
from fusetune.ops.activation import geglu, swiglu
from fusetune.ops.causal_conv1d import causal_conv1d
from fusetune.ops.cross_entropy import cross_entropy
from fusetune.ops.glu_linear import glu_linear
from fusetune.ops.grpo import grpo_loss, selective_log_softmax
from fusetune.ops.linear_attention import gated_delta_rule, gated_slot_attention
from fusetune.ops.linear_cross_entropy import linear_cross_entropy
from fusetune.ops.lm_head import HeadOutput
from fusetune.ops.lora import lora_linear, lora_mlp, lora_qkv
from fusetune.ops.moe import MoeLora, moe_mlp
from fusetune.ops.quant4 import dequantize_4bit
from fusetune.ops.rms_norm import add_rms_norm, rms_norm, rms_norm_gated
from fusetune.ops.rope import rope

__version__ = "0.1.0"

__all__ = [
    "HeadOutput",
    "MoeLora",
    "__version__",
    "add_rms_norm",
    "apply",
    "backend",
    "causal_conv1d",
    "compile_layers",
    "cross_entropy",
    "dequantize_4bit",
    "gated_delta_rule",
    "gated_slot_attention",
    "geglu",
    "glu_linear",
    "graph_train_step",
    "grpo_loss",
    "gsa",
    "linear_cross_entropy",
    "lora_linear",
    "lora_mlp",
    "lora_qkv",
    "moe_mlp",
    "nn",
    "reference",
    "revert",
    "rms_norm",
    "rms_norm_gated",
    "rope",
    "selective_log_softmax",
    "swiglu",
]
