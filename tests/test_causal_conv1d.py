"""fusetune.causal_conv1d against the float64 reference and transformers' fallback."""

from __future__ import annotations

import pytest
import torch

import fusetune
from fusetune.ops import causal_conv1d as conv_module
from fusetune.reference.causal_conv1d import causal_conv1d as reference_causal_conv1d
from harness import DEVICE, assert_close, assert_raises, check_op, matrix, tolerance


def make_inputs(batch: int, channels: int, time: int, width: int = 4, bias: bool = True):
    inputs = {
        "x": torch.randn(batch, channels, time, dtype=torch.float64) * 1.5,
        "weight": torch.randn(channels, width, dtype=torch.float64) * 0.5,
    }
    if bias:
        inputs["bias"] = torch.randn(channels, dtype=torch.float64) * 0.3
    return inputs


def run(inputs, dtype, activation="silu", **kw):
    names = list(inputs)
    return check_op(
        fusetune.causal_conv1d,
        reference_causal_conv1d,
        inputs,
        dtype=dtype,
        cast=names,
        grad=names,
        kwargs=dict(activation=activation),
        **kw,
    )


@matrix()
def test_matrix(dtype, autocast, mode, layout):
    """More time steps than one tile (32) and channels than one (64), odd sizes."""
    run(make_inputs(2, 70, 45), dtype, mode=mode, autocast=autocast, layout=layout)


@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize("width,bias", [(4, True), (2, False), (1, True), (5, False)])
def test_widths_bias_activations(width, bias, activation):
    run(make_inputs(1, 9, 37, width, bias), torch.float32, activation)


def test_time_shorter_than_the_width():
    run(make_inputs(3, 5, 2), torch.float32)


def test_transposed_projection_output_keeps_its_memory_order():
    """transformers passes the [B, T, C] projection output transposed to [B, C, T]: read in
    place, and the output comes back in the same memory order (its transpose is free)."""
    inputs = make_inputs(2, 24, 40)
    btc = inputs["x"].transpose(1, 2).contiguous().float().to(DEVICE)
    x = btc.transpose(1, 2).requires_grad_()  # a view, not a copy
    weight, bias = (inputs[k].float().to(DEVICE).requires_grad_() for k in ("weight", "bias"))
    out = fusetune.causal_conv1d(x, weight, bias, "silu")
    assert out.stride() == x.stride()
    want = reference_causal_conv1d(inputs["x"], inputs["weight"], inputs["bias"], "silu")
    assert_close("out", out, want, tolerance(torch.float32))
    out.backward(torch.randn_like(out))
    assert x.grad.stride() == x.stride() or x.grad.is_contiguous()


def test_matches_transformers_fallback():
    """transformers' causal_conv1d_fn (Qwen3.5's fallback without the causal-conv1d package)."""
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    inputs = make_inputs(2, 16, 30)
    x, weight, bias = (inputs[k].float().to(DEVICE) for k in ("x", "weight", "bias"))
    fallback = getattr(modeling.causal_conv1d_fn, "__wrapped__", modeling.causal_conv1d_fn)
    want = fallback(x, weight, bias, activation="silu")
    got = fusetune.causal_conv1d(x, weight, bias, "silu")
    assert_close("out", got, want, 4 * tolerance(torch.float32))


def test_bad_input():
    x, weight = torch.randn(2, 8, 10, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    call = fusetune.causal_conv1d
    assert_raises(ValueError, "x must be [batch, channels, time]", call, x[0], weight)
    assert_raises(ValueError, "weight must be [channels, width]", call, x, weight[:7])
    assert_raises(ValueError, "bias must have shape", call, x, weight, torch.ones(7))
    assert_raises(ValueError, "activation must be one of", call, x, weight, None, "relu")
    assert_raises(TypeError, "x must be a floating-point tensor", call, x.long(), weight)
    wide = torch.randn(8, conv_module.MAX_WIDTH + 1, device=DEVICE)
    if conv_module._utils.backend(x) != "reference":
        assert_raises(ValueError, "width must be at most", call, x, wide)


@pytest.mark.parametrize("transposed", [False, True])
def test_fake_kernels_match_real_layouts(transposed):
    """Inductor trusts the fake kernels' strides: the weight gradient came back transposed on
    the GPU while the fake said row-major (found by the compiled cases there)."""
    inputs = make_inputs(2, 24, 40)
    x = inputs["x"].float().to(DEVICE)
    if transposed:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    weight, bias = (inputs[k].float().to(DEVICE) for k in ("weight", "bias"))
    grad_out = torch.randn_like(x)
    ops = torch.ops.fusetune
    for args in [(x, weight, bias, True), (x, weight, None, False)]:
        torch.library.opcheck(ops.causal_conv1d_forward, args, test_utils="test_faketensor")
        torch.library.opcheck(
            ops.causal_conv1d_backward, (grad_out, *args), test_utils="test_faketensor"
        )
