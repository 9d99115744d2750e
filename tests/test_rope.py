"""fusetune.rope against the float64 reference and transformers' apply_rotary_pos_emb."""

from __future__ import annotations

import math

import pytest
import torch

import fusetune
from fusetune.reference.rope import rope as reference_rope
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


def rotary_table(positions: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """Angles [positions, R] as a rotary embedding makes them (each frequency twice)."""
    inv_freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    if interleaved:
        return angles.repeat_interleave(2, dim=-1)
    return torch.cat((angles, angles), dim=-1)


def make_inputs(
    layout: str,
    batch: int,
    seq_len: int,
    q_heads: int,
    k_heads: int,
    head_dim: int,
    rotary_dim: int,
    *,
    interleaved: bool = False,
    table: str = "batched",
):
    """q, k and cos/sin in one of the accepted forms: "batched" [B, T, R], "shared" [T, R], or
    "positions" (a [P, R] table with random [B, T] position_ids)."""

    def qk(heads):
        shape = (batch, seq_len, heads, head_dim)
        if layout == "BHTD":
            shape = (batch, heads, seq_len, head_dim)
        return torch.randn(shape, dtype=torch.float64) * 2

    inputs = {"q": qk(q_heads), "k": qk(k_heads)}
    if table == "positions":
        angles = rotary_table(3 * seq_len, rotary_dim, interleaved)
        inputs["position_ids"] = torch.randint(0, 3 * seq_len, (batch, seq_len))
    else:
        angles = rotary_table(seq_len, rotary_dim, interleaved)
        if table == "batched":  # per-sequence offsets, as left padding gives
            offsets = torch.arange(batch, dtype=torch.float64)[:, None, None] * 0.37
            angles = angles[None] * (1 + offsets)
    inputs["cos"], inputs["sin"] = angles.cos(), angles.sin()
    return inputs


def run(inputs, dtype, **kw):
    return check_op(
        fusetune.rope,
        reference_rope,
        inputs,
        dtype=dtype,
        cast=["q", "k", "cos", "sin"],
        grad=["q", "k"],
        **kw,
    )


VARIANTS = {  # GQA head counts that are not powers of two; partial rotary; every table form
    "BHTD-half-batched": (("BHTD", 2, 5, 6, 2, 16, 16), dict(table="batched")),
    "BTHD-interleaved-partial-positions": (
        ("BTHD", 2, 3, 3, 1, 24, 16),
        dict(table="positions", interleaved=True),
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@matrix()
def test_matrix(variant, dtype, autocast, mode, layout):
    shape, options = VARIANTS[variant]
    assert uses_kernels(torch.empty(0, dtype=dtype, device=DEVICE))
    inputs = make_inputs(*shape, **options)
    kwargs = dict(layout=shape[0], interleaved=options.get("interleaved", False))
    run(inputs, dtype, kwargs=kwargs, mode=mode, autocast=autocast, layout=layout)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("table", ["batched", "shared", "positions"])
@pytest.mark.parametrize(
    "shape",
    [
        ("BTHD", 1, 1, 1, 1, 2, 2),  # one token, one pair
        ("BHTD", 2, 7, 5, 5, 10, 6),  # MHA, odd head_dim, partial rotary
        ("BTHD", 1, 4, 40, 8, 64, 64),  # more heads than one tile holds
    ],
    ids=str,
)
def test_forms(shape, table, interleaved):
    inputs = make_inputs(*shape, table=table, interleaved=interleaved)
    kwargs = dict(layout=shape[0], interleaved=interleaved, rotary_dim=shape[-1])
    run(inputs, torch.bfloat16, kwargs=kwargs)


def test_position_ids_forms():
    """position_ids [T] and [1, T] broadcast over the batch."""
    inputs = make_inputs("BTHD", 3, 6, 2, 2, 8, 8, table="positions")
    for ids in (inputs["position_ids"][0], inputs["position_ids"][:1]):
        run(dict(inputs, position_ids=ids), torch.float32, kwargs=dict(layout="BTHD"))


def test_backward_is_the_inverse_rotation():
    """With a true rotation table, rotating the gradient back gives q itself for grad = out."""
    inputs = make_inputs("BHTD", 2, 5, 4, 2, 32, 32, table="shared")
    q = inputs["q"].float().to(DEVICE).requires_grad_()
    k = inputs["k"].float().to(DEVICE)
    cos, sin = inputs["cos"].float().to(DEVICE), inputs["sin"].float().to(DEVICE)
    q_out, _ = fusetune.rope(q, k, cos, sin, layout="BHTD")
    (q_grad,) = torch.autograd.grad(q_out, q, q_out)
    assert_close("R^T R q", q_grad, q.detach(), tolerance(torch.float32))


def test_out_of_range_position_gives_nan_not_a_read():
    if not uses_kernels(torch.empty(0, device=DEVICE)):
        pytest.skip("kernels only")
    inputs = make_inputs("BTHD", 1, 3, 2, 1, 8, 8, table="positions")
    position_ids = torch.tensor([[0, 10**6, 1]], device=DEVICE)
    args = [inputs[n].float().to(DEVICE) for n in ("q", "k", "cos", "sin")]
    q_out, k_out = fusetune.rope(*args, position_ids=position_ids)
    assert torch.isnan(q_out[0, 1]).all() and torch.isfinite(q_out[0, [0, 2]]).all()
    assert torch.isnan(k_out[0, 1]).all()


@pytest.mark.skipif(not ON_GPU, reason="benchmark-sized: GPU pass")
def test_big():
    inputs = make_inputs("BHTD", 2, 512, 32, 8, 128, 128, table="batched")
    run(inputs, torch.bfloat16, kwargs=dict(layout="BHTD"))


# ----------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("model", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_transformers(model, dtype):
    """transformers' rotary embedding makes cos/sin; our rope of q and k (BHTD, GQA) matches its
    apply_rotary_pos_emb in outputs and gradients, in the same dtype."""
    pytest.importorskip("transformers")
    if model == "llama":
        from transformers import LlamaConfig as Config
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    else:
        from transformers import Qwen2Config as Config
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding as Rotary
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    config = Config(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
    )
    rotary = Rotary(config=config).to(DEVICE)
    batch, seq_len = 2, 7
    q = torch.randn(batch, 4, seq_len, 64, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, 2, seq_len, 64, device=DEVICE, dtype=dtype)
    position_ids = torch.arange(seq_len, device=DEVICE)[None] + torch.tensor([[0], [100]]).to(
        DEVICE
    )
    cos, sin = rotary(q, position_ids)
    leaves = [t.clone().requires_grad_() for t in (q, k, q, k)]
    ours = fusetune.rope(leaves[0], leaves[1], cos, sin, layout="BHTD")
    theirs = apply_rotary_pos_emb(leaves[2], leaves[3], cos, sin)
    grads = [torch.randn_like(t) for t in theirs]
    torch.autograd.backward(ours, grads)
    torch.autograd.backward(theirs, grads)
    tol = 2 * tolerance(dtype)
    for name, a, b in zip(("q", "k"), ours, theirs, strict=True):
        assert a.dtype == b.dtype
        assert_close(name, a, b, tol)
    for name, a, b in zip(("dq", "dk"), leaves[:2], leaves[2:], strict=True):
        assert_close(name, a.grad, b.grad, tol)


def test_rotary_embedding_module():
    module = fusetune.nn.RotaryEmbedding(16, max_positions=32, layout="BTHD", device=DEVICE)
    q, k = torch.randn(2, 5, 3, 16, device=DEVICE), torch.randn(2, 5, 1, 16, device=DEVICE)
    angles = rotary_table(32, 16)
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    expected = reference_rope(q.cpu(), k.cpu(), cos[:5].cpu(), sin[:5].cpu())
    got = module(q, k)
    for a, b in zip(got, expected, strict=True):
        assert_close("module", a, b, tolerance(torch.float32))
    position_ids = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]], device=DEVICE)
    shifted = module(q, k, position_ids)
    assert_close("shifted", shifted[0][1], got[0][1], tolerance(torch.float32))
    assert not math.isclose((shifted[0][0] - got[0][0]).abs().max().item(), 0.0, abs_tol=1e-3)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_bad_input(mode):
    q, k = torch.randn(2, 5, 4, 8, device=DEVICE), torch.randn(2, 5, 2, 8, device=DEVICE)
    angles = rotary_table(5, 8)
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)

    def call(*args, **kwargs):
        fn = fusetune.rope
        if mode == "compile":
            torch._dynamo.reset()
            fn = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
        return fn(*args, **kwargs)

    assert_raises(ValueError, "q must be 4-D", call, q[0], k, cos, sin)
    assert_raises(ValueError, "k must match q", call, q, k[:, :4], cos, sin)
    assert_raises(ValueError, "k must match q", call, q, k[..., :6], cos, sin)
    assert_raises(ValueError, "cos and sin must have one shape", call, q, k, cos, sin[:, :6])
    assert_raises(ValueError, "cos and sin must be [T, R]", call, q, k, cos[:4], sin[:4])
    assert_raises(ValueError, "rotary_dim", call, q, k, cos, sin, rotary_dim=6)
    odd = torch.ones(5, 7, device=DEVICE)
    assert_raises(ValueError, "must be even", call, q, k, odd, odd)
    wide = torch.ones(5, 10, device=DEVICE)
    assert_raises(ValueError, "head_dim", call, q, k, wide, wide)
    assert_raises(ValueError, "layout must be one of|'BSHD'", call, q, k, cos, sin, layout="BSHD")
    bad_ids = torch.zeros(2, 4, dtype=torch.long, device=DEVICE)
    assert_raises(ValueError, "position_ids must be", call, q, k, cos, sin, position_ids=bad_ids)
    assert_raises(
        TypeError,
        "position_ids must be an integer",
        call,
        q,
        k,
        cos,
        sin,
        position_ids=bad_ids.float(),
    )
    assert_raises(TypeError, "cos must be a floating-point", call, q, k, cos.long(), sin)
    if mode == "eager":
        assert_raises(ValueError, "must not require grad", call, q, k, cos.requires_grad_(), sin)
