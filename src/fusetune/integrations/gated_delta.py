"""Route the Gated DeltaNet layers of a live transformers model (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)
through :func:`fusetune.gated_delta_rule`.

Where transformers looks the kernels up:
* 5.23 (and the versions with ``use_kernel_func_from_hub_with_fallback``): the layer's forward
  calls the module-level names ``torch_chunk_gated_delta_rule`` and
  ``torch_recurrent_gated_delta_rule`` of its modeling module (bound at import to a hub kernel,
  FLA or the torch loop). The seam is those two module attributes: routing swaps them for
  fusetune's adapters, unrouting puts the originals back once no routed model is left. They are
  module-wide, so while one model is routed every model of that family in the process runs
  fusetune's kernels (the same function to rounding).
* older versions: instance attributes ``chunk_gated_delta_rule`` / ``recurrent_gated_delta_rule``
  set in ``__init__``; those are swapped per layer.
Both call with FLA's argument names (q, k, v, g=, beta=, initial_state=, output_final_state=,
use_qk_l2norm_in_kernel=, cu_seqlens=, plus extras that are dropped here).

The layer's short causal convolution, ``causal_conv1d_fn`` (a module function where
transformers has one), runs before the delta rule; routing wraps it too. Without packing it
becomes :func:`fusetune.causal_conv1d` (one pass, SiLU fused, the transposed projection output
read in place). Packed sequences (padding-free batches: ``cu_seq_lens_q`` among the forward's
kwargs): transformers' torch fallback ignores the packing (each sequence's first tokens would
see the previous sequence's last ones), so those run a convolution masked at the sequence
starts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from fusetune.ops.causal_conv1d import causal_conv1d
from fusetune.ops.linear_attention.gated_delta_rule import gated_delta_rule

LAYER_CLASSES = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")
# (module global, layer attribute, fusetune mode)
SEAMS = (
    ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule", "chunk"),
    ("torch_recurrent_gated_delta_rule", "recurrent_gated_delta_rule", "recurrent"),
)
_ROUTED_FLAG = "_fusetune_gated_delta"

# modeling module name -> (saved originals {global: fn}, number of routed layers)
_MODULE_PATCHES: dict[str, tuple[dict[str, Callable], int]] = {}


def _adapter(mode: str) -> Callable:
    """A drop-in for transformers' / FLA's function: same arguments, extras ignored."""

    def run(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        chunk_size: int = 64,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        scale: float | None = None,
        **unused: object,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _call(
            query, key, value, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=bool(output_final_state), cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel), mode=mode,
        )  # fmt: skip

    run.__name__ = f"fusetune_{mode}_gated_delta_rule"
    run.__fusetune__ = True
    return run


def _call(*args, **kwargs):
    """Looked up at call time, so tests can count calls."""
    return gated_delta_rule(*args, **kwargs)


def _conv(*args):
    """Looked up at call time, so tests can count calls."""
    return causal_conv1d(*args)


ADAPTERS = {mode: _adapter(mode) for _, _, mode in SEAMS}
CONV_SEAM = "causal_conv1d_fn"
CONV_ACTIVATIONS = (None, "silu", "swish")  # what fusetune.causal_conv1d computes


def packed_causal_conv1d(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """Depthwise causal convolution of packed sequences: hidden_states [1, C, T], weight [C, W],
    offsets cu_seqlens [N + 1]; an output never reads a token of an earlier sequence. Computed
    as W shifted multiply-adds in weight's dtype (as transformers' fallback computes), the
    shifted-in tokens masked where they cross a sequence start."""
    seq_len, width = hidden_states.shape[-1], weight.shape[-1]
    x = hidden_states.to(weight.dtype)
    positions = torch.arange(seq_len, device=x.device)
    starts = cu_seqlens.to(x.device, torch.long)[:-1]
    # Position of each token inside its sequence (tokens past the last offset count on).
    start_of = starts[torch.searchsorted(starts, positions, right=True).clamp(min=1) - 1]
    offset = positions - start_of
    out = x * weight[:, -1, None]
    for shift in range(1, width):
        shifted = torch.nn.functional.pad(x, (shift, 0))[..., :seq_len]
        keep = (offset >= shift).to(x.dtype)
        out = out + shifted * keep * weight[:, width - 1 - shift, None]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = _act(activation)(out)
    return out.to(hidden_states.dtype)


def _act(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _conv_adapter(original: Callable) -> Callable:
    """Packed sequences: the masked convolution above; otherwise fusetune.causal_conv1d (one
    pass over the transposed projection output, SiLU fused) where it applies, else
    ``original``."""

    def run(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is not None:
            return packed_causal_conv1d(hidden_states, weight, bias, activation, cu_seqlens)
        if activation in CONV_ACTIVATIONS and weight.dim() == 2 and weight.shape[1] <= 16:
            return _conv(hidden_states, weight, bias, activation)
        return original(hidden_states, weight, bias, activation=activation, **kwargs)

    run.__name__ = "fusetune_packed_causal_conv1d_fn"
    run.__fusetune__ = True
    return run


def gated_delta_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in LAYER_CLASSES]


def route(model: torch.nn.Module) -> int:
    """Route every Gated DeltaNet layer of ``model`` through fusetune; returns how many layers
    (0 when the model has none). Idempotent: a layer already routed is counted, not patched
    again."""
    layers = gated_delta_layers(model)
    for layer in layers:
        if getattr(layer, _ROUTED_FLAG, None) is not None:
            continue
        saved = {}
        for _, attribute, mode in SEAMS:
            if attribute in vars(layer):
                saved[attribute] = vars(layer)[attribute]
                setattr(layer, attribute, ADAPTERS[mode])
        setattr(layer, _ROUTED_FLAG, saved)
        _patch_module(sys.modules[type(layer).__module__])
    return len(layers)


def unroute(model: torch.nn.Module) -> int:
    """Undo :func:`route` on ``model``; returns how many layers were restored."""
    restored = 0
    for layer in gated_delta_layers(model):
        saved = getattr(layer, _ROUTED_FLAG, None)
        if saved is None:
            continue
        for attribute, original in saved.items():
            setattr(layer, attribute, original)
        delattr(layer, _ROUTED_FLAG)
        _unpatch_module(sys.modules[type(layer).__module__])
        restored += 1
    return restored


def _patch_module(module) -> None:
    originals, count = _MODULE_PATCHES.get(module.__name__, ({}, 0))
    if count == 0:
        originals = {}
        for name, _, mode in SEAMS:
            if hasattr(module, name):
                originals[name] = getattr(module, name)
                setattr(module, name, ADAPTERS[mode])
        if hasattr(module, CONV_SEAM):
            originals[CONV_SEAM] = getattr(module, CONV_SEAM)
            setattr(module, CONV_SEAM, _conv_adapter(originals[CONV_SEAM]))
    _MODULE_PATCHES[module.__name__] = (originals, count + 1)


def _unpatch_module(module) -> None:
    originals, count = _MODULE_PATCHES.get(module.__name__, ({}, 0))
    if count <= 1:
        for name, original in originals.items():
            setattr(module, name, original)
        _MODULE_PATCHES.pop(module.__name__, None)
    else:
        _MODULE_PATCHES[module.__name__] = (originals, count - 1)
