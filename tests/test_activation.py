"""fusetune.swiglu / geglu and the functional backward entries against float64 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusetune
from fusetune.ops import activation as activation_module
from fusetune.reference.activation import geglu as reference_geglu
from fusetune.reference.activation import swiglu as reference_swiglu
from harness import (
    DEVICE,
    ON_GPU,
    assert_close,
    assert_raises,
    check_op,
    matrix,
    tolerance,
    uses_kernels,
)

# exp overflowing to inf is expected inside sigmoid and tanh; the interpreter's numpy warns.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")


def make_inputs(shape: tuple[int, ...], spread: float = 3.0):
    """gate spread wide enough to reach both tails of the activation."""
    return {
        "gate": torch.randn(shape, dtype=torch.float64) * spread,
        "up": torch.randn(shape, dtype=torch.float64),
    }


OPS = {
    "swiglu": (fusetune.swiglu, reference_swiglu, {}),
    "geglu": (fusetune.geglu, reference_geglu, {"approximate": "none"}),
    "geglu-tanh": (fusetune.geglu, reference_geglu, {"approximate": "tanh"}),
}


def run(name, inputs, dtype, **kw):
    op, reference, kwargs = OPS[name]
    return check_op(
        op,
        reference,
        inputs,
        dtype=dtype,
        cast=["gate", "up"],
        grad=["gate", "up"],
        kwargs=kwargs,
        **kw,
    )


@pytest.mark.parametrize("name", list(OPS))
@matrix()
def test_matrix(name, dtype, autocast, mode, layout):
    assert uses_kernels(torch.empty(0, dtype=dtype, device=DEVICE))
    run(name, make_inputs((2, 3, 130)), dtype, mode=mode, autocast=autocast, layout=layout)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("shape", [(1,), (7,), (1, 1), (3, 2304), (2, 4099), (4, 896)], ids=str)
def test_shapes(name, shape):
    """1-D, one element, widths that are not powers of two, rows longer than one tile."""
    run(name, make_inputs(shape), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_extreme_gates_stay_finite(dtype):
    """|gate| up to 60000 (fp16's range): exp overflows to inf inside silu, the results may not."""
    gate = torch.tensor([-6e4, -100.0, -20.0, 0.0, 20.0, 100.0, 6e4], dtype=torch.float64)
    inputs = {"gate": gate.reshape(1, -1), "up": torch.full((1, 7), 0.5, dtype=torch.float64)}
    for name in OPS:
        run(name, inputs, dtype, atol=1e-6)


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_mixed_dtypes(name):
    """bf16 gate, fp32 up: the output has the promoted dtype, each gradient its input's."""
    op, reference, kwargs = OPS[name]
    inputs = make_inputs((4, 40))
    gate = inputs["gate"].bfloat16().to(DEVICE).requires_grad_()
    up = inputs["up"].float().to(DEVICE).requires_grad_()
    gate64 = gate.detach().double().cpu().requires_grad_()
    up64 = up.detach().double().cpu().requires_grad_()
    out, expected = op(gate, up, **kwargs), reference(gate64, up64, **kwargs)
    assert out.dtype == torch.float32
    grad = torch.randn_like(expected)
    out.backward(grad.float().to(DEVICE))
    expected.backward(grad)
    assert_close("out", out, expected, tolerance(torch.float32))
    assert gate.grad.dtype == torch.bfloat16 and up.grad.dtype == torch.float32
    assert_close("dgate", gate.grad, gate64.grad, tolerance(torch.bfloat16))
    assert_close("dup", up.grad, up64.grad, tolerance(torch.float32))


# ----------------------------------------------------------------------------- functional entries


def _expected_backward(name, gate, up, grad_out):
    _, reference, kwargs = OPS[name]
    gate64, up64 = gate.double().cpu().requires_grad_(), up.double().cpu().requires_grad_()
    out = reference(gate64, up64, **kwargs)
    out.backward(grad_out.double().cpu())
    return out.detach(), gate64.grad, up64.grad


def _functional_backward(name, grad_out, gate, up, **kw):
    if name == "swiglu":
        return activation_module.swiglu_backward(grad_out, gate, up, **kw)
    approximate = OPS[name][2]["approximate"]
    return activation_module.geglu_backward(grad_out, gate, up, approximate, **kw)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_functional_backward(name, inplace, dtype):
    """swiglu_backward / geglu_backward from (grad_out, gate, up) alone, with the recomputed
    output; in place they overwrite gate, up and grad_out."""
    inputs = make_inputs((5, 70))
    gate, up = inputs["gate"].to(dtype).to(DEVICE), inputs["up"].to(dtype).to(DEVICE)
    grad_out = torch.randn(5, 70, device=DEVICE).to(dtype)
    expected = _expected_backward(name, gate, up, grad_out)
    buffers = (grad_out.data_ptr(), gate.data_ptr(), up.data_ptr())
    got = _functional_backward(name, grad_out, gate, up, return_output=True, inplace=inplace)
    for label, a, b in zip(("out", "dgate", "dup"), got, expected, strict=True):
        assert a.dtype == dtype
        assert_close(label, a, b, tolerance(dtype))
    assert (tuple(t.data_ptr() for t in got) == buffers) == inplace
    fresh = [torch.randn(5, 70, device=DEVICE) for _ in range(3)]
    assert len(_functional_backward(name, *fresh)) == 2  # (dgate, dup) without return_output


def test_functional_forward_and_checks():
    gate, up = torch.randn(3, 20, device=DEVICE), torch.randn(3, 20, device=DEVICE)
    if not uses_kernels(gate):
        pytest.skip("the functional entries are kernel-only")
    assert_close(
        "glu_forward",
        activation_module.glu_forward(gate, up, "silu"),
        F.silu(gate) * up,
        tolerance(torch.float32),
    )
    assert_raises(
        ValueError, "activation must be one of", activation_module.glu_forward, gate, up, "relu"
    )
    assert_raises(
        ValueError,
        "grad_out must have gate's shape",
        activation_module.swiglu_backward,
        gate[:2],
        gate,
        up,
    )
    strided = torch.randn(20, 3, device=DEVICE).t()
    assert_raises(
        ValueError,
        "inplace needs gate",
        activation_module.swiglu_backward,
        up.clone(),
        strided,
        up.clone(),
        inplace=True,
    )


@pytest.mark.skipif(not ON_GPU, reason="benchmark-sized: GPU pass")
def test_big():
    run("swiglu", make_inputs((256, 14336)), torch.bfloat16)


# ----------------------------------------------------------------------------- modules


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_mlp_matches_transformers(activation):
    """GatedMLP loads a LlamaMLP / GemmaMLP state dict and matches it, output and gradients."""
    pytest.importorskip("transformers")
    if activation == "silu":
        from transformers import LlamaConfig as Config
        from transformers.models.llama.modeling_llama import LlamaMLP as MLP
    else:
        from transformers import GemmaConfig as Config
        from transformers.models.gemma.modeling_gemma import GemmaMLP as MLP
    config = Config(
        hidden_size=48,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=12,
        hidden_act="gelu_pytorch_tanh",
    )
    if activation == "silu":
        config.hidden_act = "silu"
    theirs = MLP(config).to(DEVICE)
    ours = fusetune.nn.GatedMLP(48, 96, activation, device=DEVICE)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 48, device=DEVICE)
    y_ours, y_theirs = ours(x), theirs(x)
    assert_close("y", y_ours, y_theirs, tolerance(torch.float32))
    y_ours.square().sum().backward()
    y_theirs.square().sum().backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert_close(name, p.grad, q.grad, tolerance(torch.float32))


def test_mlp_modules_under_autocast():
    module = fusetune.nn.SwiGLUMLP(32, 64, device=DEVICE)
    x = torch.randn(3, 32, device=DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = module(x)
    assert y.dtype == torch.bfloat16
    assert fusetune.nn.GeGLUMLP(32, 64).activation == "gelu_tanh"
    assert_raises(ValueError, "activation must be one of", fusetune.nn.GatedMLP, 8, 8, "relu")


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_bad_input(mode):
    gate, up = torch.randn(4, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE)

    def call(fn, *args, **kwargs):
        if mode == "compile":
            torch._dynamo.reset()
            fn = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
        return fn(*args, **kwargs)

    assert_raises(
        ValueError, "gate and up must have one shape", call, fusetune.swiglu, gate, up[:, :8]
    )
    assert_raises(
        TypeError, "gate must be a floating-point", call, fusetune.swiglu, gate.long(), up
    )
    assert_raises(TypeError, "up must be a floating-point", call, fusetune.geglu, gate, up.int())
    assert_raises(
        ValueError, "approximate must be one of|'fast'", call, fusetune.geglu, gate, up, "fast"
    )
    assert_raises(ValueError, "at least one dim", call, fusetune.swiglu, gate[0, 0], up[0, 0])
