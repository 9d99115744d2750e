"""Property tests of the ops' boundaries (hypothesis): random shapes (0 and 1 rows, odd widths),
layouts (contiguous or strided rows), dtypes, ignore patterns and option combinations for
cross_entropy, rms_norm, rope and lora_linear, each against its float64 reference through the
harness's ``check_op`` (the same tolerances as the ops' own tests).

Bounded for CI: a few examples a property, derandomized (the same cases on every run), no
deadline (the CPU runs the kernels through Triton's interpreter). ``FUSETUNE_PROPERTY_EXAMPLES``
raises the count for a longer search."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import fusetune
from fusetune.reference.cross_entropy import cross_entropy as reference_cross_entropy
from fusetune.reference.lora import lora_linear as reference_lora_linear
from fusetune.reference.rms_norm import CASTINGS
from fusetune.reference.rms_norm import rms_norm as reference_rms_norm
from fusetune.reference.rope import rope as reference_rope
from harness import ON_GPU, check_op, tolerance

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("FUSETUNE_PROPERTY_EXAMPLES", "25"))
BOUNDED = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
ROWS = st.one_of(st.sampled_from([0, 1]), st.integers(2, 7))  # the edges drawn often
ODD = st.integers(0, 40).map(lambda n: 2 * n + 1)  # 1, 3, ..., 81
# rms_norm over 1 element is sign(x) w, and its dx = w g eps / (x^2 + eps)^1.5 the difference
# of two terms up to 1/sqrt(eps) larger: ill-conditioned, no relative tolerance holds; from 3 on
WIDE_ODD = st.integers(1, 40).map(lambda n: 2 * n + 1)
LAYOUTS = st.sampled_from(["contiguous", "noncontiguous"])
SEEDS = st.integers(0, 2**31 - 1)
IGNORE = -100


def interpreter_factor(dtype: torch.dtype) -> float:
    """Triton 3.9's interpreter rounds fp32 -> bf16 toward zero (every store and ``.to``; fp16
    rounds to nearest), so each bf16 cast in a kernel can cost a whole ulp, in one direction,
    where the GPU's round-to-nearest costs half. With two or three casts in a row (rms_norm's
    "none" casting, LoRA's bf16 intermediates) and a handful of elements, nothing averages out:
    measured up to 3 ulps (1.4e-2 relative). The GPU keeps the table's tolerance."""
    return 3.0 if dtype == torch.bfloat16 and not ON_GPU else 1.0


def _layout(layout: str, inputs: dict[str, torch.Tensor]) -> str:
    """The harness strides every input; where one cannot be strided (no element, or a single
    row, which is contiguous whatever its stride) the case runs contiguous."""

    def strideable(t: torch.Tensor) -> bool:
        if t.dim() == 0:
            return True
        return t.numel() > 0 and (t.shape[0] if t.dim() == 1 else t[..., 0].numel()) > 1

    return layout if all(strideable(t) for t in inputs.values()) else "contiguous"


def _labels(shape: tuple[int, ...], vocab: int, pattern: str) -> torch.Tensor:
    labels = torch.randint(0, vocab, shape)
    flat = labels.view(-1)
    if pattern == "all":
        flat.fill_(IGNORE)
    elif pattern == "alternate":
        flat[::2] = IGNORE
    elif pattern == "random":
        flat[torch.rand(flat.shape) < 0.3] = IGNORE
    return labels


@BOUNDED
@given(
    seed=SEEDS,
    rows=ROWS,
    vocab=ODD,
    batched=st.booleans(),
    dtype=DTYPES,
    layout=LAYOUTS,
    ignore=st.sampled_from(["none", "random", "alternate", "all"]),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    smoothing=st.sampled_from([0.0, 0.1]),
    softcap=st.sampled_from([None, 20.0]),
    scale=st.sampled_from([None, 0.5]),
    z_loss=st.sampled_from([0.0, 1e-3]),
    num_items=st.sampled_from([None, 7.0]),
)
def test_cross_entropy_boundaries(
    seed, rows, vocab, batched, dtype, layout, ignore, reduction, smoothing, softcap, scale,
    z_loss, num_items,
):  # fmt: skip
    torch.manual_seed(seed)
    lead = (2, rows) if batched else (rows,)
    inputs = {
        "logits": torch.randn(*lead, vocab, dtype=torch.float64) * 4,
        "labels": _labels(lead, vocab, ignore),
    }
    options = dict(
        reduction=reduction, label_smoothing=smoothing, logit_softcap=softcap,
        logit_scale=scale, z_loss=z_loss, return_z_loss=z_loss > 0,
        num_items=None if reduction == "none" else num_items,
    )  # fmt: skip
    check_op(
        fusetune.cross_entropy,
        reference_cross_entropy,
        inputs,
        dtype=dtype,
        cast=["logits"],
        grad=["logits"],
        kwargs=options,
        layout=_layout(layout, inputs),
        compute_dtype=torch.float32,
        output_dtypes=[torch.float32] * (2 if z_loss > 0 else 1),
        atol=1e-5,  # a one-word vocabulary's loss and gradient are exactly 0: fp32 rounding
        tolerance_factor=interpreter_factor(dtype),
    )


@BOUNDED
@given(
    seed=SEEDS,
    rows=ROWS,
    hidden=WIDE_ODD,
    batched=st.booleans(),
    dtype=DTYPES,
    layout=LAYOUTS,
    casting=st.sampled_from(CASTINGS),
    offset=st.sampled_from([None, 0.0, 1.0]),
    eps=st.sampled_from([1e-6, 1e-2]),
)
def test_rms_norm_boundaries(seed, rows, hidden, batched, dtype, layout, casting, offset, eps):
    torch.manual_seed(seed)
    lead = (2, rows) if batched else (rows,)
    inputs = {
        "x": torch.randn(*lead, hidden, dtype=torch.float64),
        "weight": 1 + 0.2 * torch.randn(hidden, dtype=torch.float64),
    }
    check_op(
        fusetune.rms_norm,
        reference_rms_norm,
        inputs,
        dtype=dtype,
        cast=["x", "weight"],
        grad=["x", "weight"],
        kwargs=dict(eps=eps, offset=offset, casting=casting),
        layout=_layout(layout, inputs),
        # 1 or 2 rows: dw is a sum of one or two O(1) terms that can cancel; its error is relative
        # to them (and the float64 reference does not round the normalised value as the op does)
        atol=2 * tolerance(dtype),
        tolerance_factor=interpreter_factor(dtype),
    )


@BOUNDED
@given(
    seed=SEEDS,
    batch=st.integers(1, 2),
    seq_len=ROWS,
    heads=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    half_dims=st.integers(1, 12).flatmap(lambda d: st.tuples(st.just(d), st.integers(1, d))),
    extra=st.sampled_from([0, 1]),  # an odd head_dim: the dims past the rotary ones pass through
    dtype=DTYPES,
    layout=LAYOUTS,
    qk_layout=st.sampled_from(["BTHD", "BHTD"]),
    interleaved=st.booleans(),
    table=st.sampled_from(["shared", "batched", "positions"]),
)
def test_rope_boundaries(
    seed, batch, seq_len, heads, half_dims, extra, dtype, layout, qk_layout, interleaved, table
):
    torch.manual_seed(seed)
    head_dim, rotary_dim = 2 * half_dims[0] + extra, 2 * half_dims[1]

    def qk(count: int) -> torch.Tensor:
        shape = (batch, seq_len, count, head_dim)
        if qk_layout == "BHTD":
            shape = (batch, count, seq_len, head_dim)
        return torch.randn(shape, dtype=torch.float64) * 2

    inputs = {"q": qk(heads[0]), "k": qk(heads[1])}
    positions = 3 * seq_len + 1 if table == "positions" else seq_len
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * torch.rand(rotary_dim) * 3
    if table == "positions":
        inputs["position_ids"] = torch.randint(0, positions, (batch, seq_len))
    elif table == "batched":
        angles = angles[None] * (1 + 0.37 * torch.arange(batch, dtype=torch.float64))[:, None, None]
    inputs["cos"], inputs["sin"] = angles.cos(), angles.sin()
    check_op(
        fusetune.rope,
        reference_rope,
        inputs,
        dtype=dtype,
        cast=["q", "k", "cos", "sin"],
        grad=["q", "k"],
        kwargs=dict(layout=qk_layout, interleaved=interleaved),
        layout=_layout(layout, inputs),
        tolerance_factor=interpreter_factor(dtype),
    )


@BOUNDED
@given(
    seed=SEEDS,
    rows=ROWS,
    batched=st.booleans(),
    in_features=ODD,
    out_features=ODD,
    rank=st.integers(1, 8),
    base=DTYPES,
    fp32_adapters=st.booleans(),
    bias=st.booleans(),
    scaling=st.sampled_from([0.5, 2.0]),
    layout=LAYOUTS,
)
def test_lora_linear_boundaries(
    seed, rows, batched, in_features, out_features, rank, base, fp32_adapters, bias, scaling,
    layout,
):  # fmt: skip
    torch.manual_seed(seed)
    lead = (2, rows) if batched else (rows,)
    inputs = {
        "x": torch.randn(*lead, in_features, dtype=torch.float64),
        "weight": torch.randn(out_features, in_features, dtype=torch.float64) / in_features**0.5,
        "lora_a": torch.randn(rank, in_features, dtype=torch.float64) / in_features**0.5,
        "lora_b": torch.randn(out_features, rank, dtype=torch.float64) / rank**0.5,
    }
    if bias:
        inputs["bias"] = torch.randn(out_features, dtype=torch.float64)
    adapter = torch.float32 if fp32_adapters else base
    dtypes = {"x": base, "weight": base, "bias": base, "lora_a": adapter, "lora_b": adapter}
    check_op(
        functools.partial(fusetune.lora_linear, scaling=scaling),
        functools.partial(reference_lora_linear, scaling=scaling),
        inputs,
        dtype=base,
        cast=list(inputs),
        grad=["x", "lora_a", "lora_b"],
        input_dtypes={k: dtypes[k] for k in inputs},
        compute_dtype=base,
        output_dtypes=[base],
        layout=_layout(layout, inputs),
        # one output element can be the difference of x W and the adapter's term (both O(1)
        # here): its error is relative to them, not to the difference
        atol=2 * tolerance(base),
        tolerance_factor=interpreter_factor(base),
    )
