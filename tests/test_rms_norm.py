"""fusetune.rms_norm / add_rms_norm / rms_norm_gated against the float64 reference and
transformers' modules."""

from __future__ import annotations

import pytest
import torch

import fusetune
from fusetune.ops import rms_norm as rms_module
from fusetune.reference.rms_norm import CASTINGS
from fusetune.reference.rms_norm import add_rms_norm as reference_add_rms_norm
from fusetune.reference.rms_norm import rms_norm as reference_rms_norm
from fusetune.reference.rms_norm import rms_norm_gated as reference_rms_norm_gated
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

EPS = 1e-6


def make_inputs(shape: tuple[int, ...], casting: str = "llama", *, residual: bool = False):
    """x with a nonzero mean and spread (as activations have), and a weight around its
    identity value: 1 for offset 0, 0 for Gemma's offset 1."""
    x = torch.randn(shape, dtype=torch.float64) * 2.0 + 0.5
    weight = torch.randn(shape[-1], dtype=torch.float64) * 0.3
    if casting != "gemma":
        weight += 1.0
    if not residual:
        return {"x": x, "weight": weight}
    return {"x": x, "residual": torch.randn(shape, dtype=torch.float64) * 3.0, "weight": weight}


def run_norm(inputs, dtype, casting="llama", **kw):
    return check_op(
        fusetune.rms_norm,
        reference_rms_norm,
        inputs,
        dtype=dtype,
        cast=["x", "weight"],
        grad=["x", "weight"],
        kwargs=dict(eps=EPS, casting=casting),
        **kw,
    )


VARIANTS = {  # casting, shape: hidden sizes that are not powers of two
    "llama-3d": ("llama", (2, 3, 96)),
    "gemma-2d": ("gemma", (5, 80)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@matrix()
def test_matrix(variant, dtype, autocast, mode, layout):
    casting, shape = VARIANTS[variant]
    assert uses_kernels(torch.empty(0, dtype=dtype, device=DEVICE))
    inputs = make_inputs(shape, casting)
    run_norm(inputs, dtype, casting, mode=mode, autocast=autocast, layout=layout)


@matrix()
def test_add_rms_norm_matrix(dtype, autocast, mode, layout):
    inputs = make_inputs((3, 2, 72), residual=True)
    check_op(
        fusetune.add_rms_norm,
        reference_add_rms_norm,
        inputs,
        dtype=dtype,
        cast=["x", "residual", "weight"],
        grad=["x", "residual", "weight"],
        kwargs=dict(eps=EPS),
        mode=mode,
        autocast=autocast,
        layout=layout,
    )


def gated_inputs(shape: tuple[int, ...], casting: str = "llama"):
    """make_inputs' x and weight, and a gate spread over silu's bend (|z| up to ~6)."""
    return {**make_inputs(shape, casting), "gate": torch.randn(shape, dtype=torch.float64) * 2.0}


def run_gated(inputs, dtype, casting="llama", **kw):
    return check_op(
        fusetune.rms_norm_gated,
        reference_rms_norm_gated,
        inputs,
        dtype=dtype,
        cast=["x", "gate", "weight"],
        grad=["x", "gate", "weight"],
        kwargs=dict(eps=EPS, casting=casting),
        **kw,
    )


@matrix()
def test_rms_norm_gated_matrix(dtype, autocast, mode, layout):
    """Qwen3.5's Gated DeltaNet norm: rows of head_v_dim (here not a power of two)."""
    run_gated(gated_inputs((2, 5, 3, 48)), dtype, mode=mode, autocast=autocast, layout=layout)


@pytest.mark.parametrize("casting", CASTINGS)
def test_rms_norm_gated_castings(casting):
    run_gated(gated_inputs((7, 40), casting), torch.bfloat16, casting)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_gated_matches_transformers(dtype):
    """Qwen3_5RMSNormGated (transformers) with the same weights: outputs and the gradients of
    x, gate and weight. transformers rounds the product before the gate in bf16, fusetune
    once at the end: the bound is twice the dtype's."""
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    hf = modeling.Qwen3_5RMSNormGated(64, eps=EPS).to(DEVICE, dtype)
    with torch.no_grad():
        hf.weight.copy_(make_inputs((1, 64))["weight"])
    inputs = gated_inputs((3, 4, 64))
    ours = fusetune.nn.RMSNormGated(64, EPS, device=DEVICE, dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    args = {name: inputs[name].to(DEVICE, dtype) for name in ("x", "gate")}
    assert_module_matches(ours, hf, args, 2 * tolerance(dtype))


def assert_module_matches(ours, hf, args: dict, tol: float) -> None:
    """``ours`` and transformers' ``hf`` on the same ``args`` (positional, by name): the output
    (and its dtype), each argument's gradient and the weight's, within ``tol``."""
    leaves = [{n: t.clone().requires_grad_() for n, t in args.items()} for _ in range(2)]
    y_ours, y_hf = ours(*leaves[0].values()), hf(*leaves[1].values())
    grad = torch.randn_like(y_hf)
    y_ours.backward(grad)
    y_hf.backward(grad)
    assert y_ours.dtype == y_hf.dtype
    assert_close("y", y_ours, y_hf, tol)
    for name in args:
        assert_close(f"d{name}", leaves[0][name].grad, leaves[1][name].grad, tol)
    assert_close("dweight", ours.weight.grad, hf.weight.grad, tol)


def test_rms_norm_gated_bad_gate():
    x, weight = torch.randn(4, 32, device=DEVICE), torch.ones(32, device=DEVICE)
    gated = fusetune.rms_norm_gated
    assert_raises(ValueError, "gate must have x's shape", gated, x, x[:2], weight)
    assert_raises(TypeError, "gate must be a floating-point tensor", gated, x, x.long(), weight)


@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("shape", [(1, 2), (1, 896), (3, 2304), (200, 40), (2, 7, 700)], ids=str)
def test_shapes(casting, shape):
    """Odd hidden sizes, one row; (200, 40) and (2, 7, 700) give the backward more
    row tiles than programs, so each program loops and accumulates its weight partial."""
    dtype = torch.float32 if casting == "none" else torch.bfloat16
    run_norm(make_inputs(shape, casting), dtype, casting, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_none_casting_rounds_like_the_input_dtype(dtype):
    """ "none" rounds three times in the input dtype: compare with the reference run in that
    very dtype (the same roundings), and with float64 at twice the single-pass tolerance."""
    inputs = make_inputs((6, 160), "none")
    x, weight = inputs["x"].to(dtype), inputs["weight"].to(dtype)
    out = fusetune.rms_norm(x.to(DEVICE), weight.to(DEVICE), EPS, casting="none")
    same_dtype = reference_rms_norm(x, weight, EPS, casting="none")
    exact = reference_rms_norm(x.double(), weight.double(), EPS, casting="none")
    # not tighter: the interpreter rounds to bf16 differently from the GPU (NOTES.md)
    assert_close("vs same dtype", out, same_dtype, tolerance(dtype))
    assert_close("vs float64", out, exact, 2 * tolerance(dtype))


def test_single_column():
    """H = 1: y = x / sqrt(x^2 + eps) * w. dx = rstd dy w (1 - h^2) cancels; a large eps keeps
    1 - h^2 away from 0, so the comparison measures the kernel, not fp32 cancellation."""
    check_op(
        fusetune.rms_norm,
        reference_rms_norm,
        make_inputs((5, 1)),
        dtype=torch.float32,
        cast=["x", "weight"],
        grad=["x", "weight"],
        kwargs=dict(eps=0.5),
        atol=1e-6,
    )


def test_offset_and_eps():
    inputs = make_inputs((4, 100))
    kwargs = dict(eps=0.5, offset=0.25, casting="llama")
    check_op(
        fusetune.rms_norm,
        reference_rms_norm,
        inputs,
        dtype=torch.float32,
        cast=["x", "weight"],
        grad=["x", "weight"],
        kwargs=kwargs,
    )


def test_gemma_default_offset_is_one():
    x, weight = torch.randn(3, 64, device=DEVICE), torch.zeros(64, device=DEVICE)
    assert_close(
        "identity weight",
        fusetune.rms_norm(x, weight, casting="gemma"),
        fusetune.rms_norm(x, weight + 1, casting="llama"),
        tolerance(torch.float32),
    )


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["w32", "w16"])
def test_mixed_dtypes(weight_dtype):
    """bf16 x with an fp32 weight: y in x's dtype, dweight in the weight's dtype; and the
    residual add of a bf16 x to an fp32 residual stream stays fp32."""
    inputs = make_inputs((5, 48), residual=True)
    x = inputs["x"].bfloat16().to(DEVICE).requires_grad_()
    residual = inputs["residual"].float().to(DEVICE).requires_grad_()
    weight = inputs["weight"].to(weight_dtype).to(DEVICE).requires_grad_()
    leaves64 = [t.detach().double().cpu().requires_grad_() for t in (x, residual, weight)]
    out = fusetune.rms_norm(x, weight)
    expected = reference_rms_norm(leaves64[0], leaves64[2])
    assert out.dtype == torch.bfloat16
    grad = torch.randn_like(expected)
    out.backward(grad.to(DEVICE, out.dtype))
    expected.backward(grad)
    assert_close("y", out, expected, tolerance(torch.bfloat16))
    assert weight.grad.dtype == weight_dtype
    assert_close("dweight", weight.grad, leaves64[2].grad, tolerance(torch.bfloat16))

    for t in (x, weight, *leaves64):
        t.grad = None
    normed, new_residual = fusetune.add_rms_norm(x, residual, weight)
    ref_normed, ref_residual = reference_add_rms_norm(*leaves64)
    assert normed.dtype == new_residual.dtype == torch.float32
    grads = [torch.randn_like(ref_normed), torch.randn_like(ref_residual)]
    torch.autograd.backward([normed, new_residual], [g.float().to(DEVICE) for g in grads])
    torch.autograd.backward([ref_normed, ref_residual], grads)
    for name, got, want in zip(
        ("dx", "dresidual", "dweight"), (x, residual, weight), leaves64, strict=True
    ):
        assert got.grad.dtype == got.dtype
        assert_close(name, got.grad, want.grad, tolerance(got.dtype, weight_dtype))


def test_weight_without_grad_and_no_residual_grad():
    x = torch.randn(4, 50, device=DEVICE, requires_grad=True)
    weight = torch.rand(50, device=DEVICE) + 0.5
    fusetune.rms_norm(x, weight).sum().backward()
    assert weight.grad is None and x.grad is not None
    # only the normed output used: the gradient reaching the new residual is zero
    x.grad = None
    residual = torch.randn(4, 50, device=DEVICE)
    normed, _ = fusetune.add_rms_norm(x, residual, weight)
    normed.sum().backward()
    x64 = x.detach().double().cpu().requires_grad_()
    reference_add_rms_norm(x64, residual.double().cpu(), weight.double().cpu())[0].sum().backward()
    assert_close("dx", x.grad, x64.grad, tolerance(torch.float32))


def test_weight_gradient_is_deterministic():
    x = torch.randn(300, 96, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(96, device=DEVICE, requires_grad=True)
    grads = []
    for _ in range(2):
        fusetune.rms_norm(x, weight).square().sum().backward()
        grads.append(weight.grad)
        weight.grad = None
    assert torch.equal(grads[0], grads[1])


def test_launch_plan():
    for hidden in (1, 40, 896, 2304, 4096, 16384, 65536):
        plan = rms_module._launch_plan(hidden)
        assert plan.block_cols >= hidden and plan.block_rows >= 1
        assert 1 <= plan.num_warps <= 32


@pytest.mark.skipif(not ON_GPU, reason="big rows: GPU pass (covered small on the CPU)")
@pytest.mark.parametrize("hidden", [4096, 16384, 65536])
def test_big_rows(hidden):
    run_norm(make_inputs((64, hidden)), torch.bfloat16)


# ----------------------------------------------------------------------------- transformers


def _hf_norm(kind: str, hidden: int, dtype: torch.dtype):
    transformers = pytest.importorskip("transformers")
    del transformers
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        return LlamaRMSNorm(hidden, eps=EPS).to(DEVICE, dtype), "llama"
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    return Gemma2RMSNorm(hidden, eps=EPS).to(DEVICE, dtype), "gemma"


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_transformers(kind, dtype):
    """Same dtype, same weights: outputs and gradients of x and weight agree with
    LlamaRMSNorm / Gemma2RMSNorm (both round; so the bound is twice the dtype's)."""
    hf, casting = _hf_norm(kind, 320, dtype)
    with torch.no_grad():
        hf.weight.copy_(make_inputs((1, 320), casting)["weight"])
    ours = fusetune.nn.RMSNorm(320, EPS, casting=casting, device=DEVICE, dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    x = (torch.randn(2, 9, 320, device=DEVICE) * 2).to(dtype)
    assert_module_matches(ours, hf, {"x": x}, 2 * tolerance(dtype))


def test_module_with_residual():
    norm = fusetune.nn.RMSNorm(64, device=DEVICE)
    x, residual = torch.randn(3, 64, device=DEVICE), torch.randn(3, 64, device=DEVICE)
    normed, new_residual = norm(x, residual)
    assert_close("sum", new_residual, x + residual, tolerance(torch.float32))
    assert_close("normed", normed, norm(x + residual), tolerance(torch.float32))
    assert "casting='llama'" in repr(norm)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_bad_input(mode):
    x = torch.randn(4, 32, device=DEVICE)
    weight = torch.ones(32, device=DEVICE)

    def call(*args, **kwargs):
        fn = fusetune.rms_norm
        if mode == "compile":
            torch._dynamo.reset()
            fn = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
        return fn(*args, **kwargs)

    # (under dynamic compile the sizes print symbolically, so match the words only there)
    sizes = "|(32,)|got (31,)" if mode == "eager" else ""
    assert_raises(ValueError, "weight must have shape" + sizes, call, x, weight[:31])
    assert_raises(ValueError, "weight must have shape", call, x, weight.view(2, 16))
    assert_raises(
        ValueError, "casting must be one of|'mistral'", call, x, weight, casting="mistral"
    )
    assert_raises(ValueError, "eps must be in", call, x, weight, -1.0)
    assert_raises(TypeError, "x must be a floating-point tensor", call, x.long(), weight)
    assert_raises(TypeError, "weight must be a floating-point tensor", call, x, weight.int())
    assert_raises(ValueError, "x must have a non-empty last", call, x[:, :0], weight[:0])
    assert_raises(
        ValueError, "residual must have x's shape", fusetune.add_rms_norm, x, x[:2], weight
    )
    if DEVICE.type == "cpu" and mode == "eager":
        assert_raises(ValueError, "tensors must be on one device", call, x, weight.to("meta"))


def test_hidden_beyond_the_kernel_limit():
    x = torch.empty(1, rms_module.MAX_HIDDEN + 1, device=DEVICE)
    weight = torch.ones(x.shape[-1], device=DEVICE)
    assert_raises(ValueError, "at most 65536", fusetune.rms_norm, x, weight)
