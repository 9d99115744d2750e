"""fusetune.gated_delta_rule (chunk and recurrent modes) against its float64 reference, and the
reference against transformers' own torch implementations (a second, independent oracle).

Tolerances: GSA's table (tests/test_gsa.py): the state is a recurrence over the whole sequence and
dg a reverse running sum of terms that cancel, so fp32 5e-5 and fp16 1e-2; bf16 keeps 1e-2.
"""

from __future__ import annotations

import inspect
import math
import sys

import pytest
import torch
import torch.nn.functional as F

import fusetune
import harness
from fusetune._triton import tl, triton
from fusetune.ops.linear_attention import gdr_chunk, gdr_recurrent
from fusetune.reference.gated_delta_rule import gated_delta_rule as reference_op
from harness import DEVICE, ON_GPU, assert_close, assert_raises, check_op, matrix, uses_kernels
from packed import check_bad_cu_seqlens_values, per_sequence

GDR_TOLERANCES = {torch.float32: 5e-5, torch.float16: 1e-2}
ALGOS = ["chunk", "recurrent"]


@pytest.fixture(autouse=True)
def _gdr_tolerances(monkeypatch):
    for dtype, tol in GDR_TOLERANCES.items():
        monkeypatch.setitem(harness.TOLERANCES, dtype, tol)


def make_inputs(
    batch=2,
    seq_len=13,
    key_heads=1,
    value_heads=2,
    key_dim=12,
    value_dim=20,
    *,
    n_seq=None,
    initial_state=True,
    unit_keys=True,
    decay_scale=1.0,
):
    """Random inputs as a Qwen3.5 layer makes them: g = -A softplus(a) (from -0.01 to about
    -3), beta = sigmoid(b). Keys of norm ~1 (``unit_keys``) keep I - beta k k^T contracting, as
    the l2norm does in the models; raw keys are for the l2norm tests."""
    q = torch.randn(batch, seq_len, key_heads, key_dim, dtype=torch.float64)
    k = torch.randn(batch, seq_len, key_heads, key_dim, dtype=torch.float64)
    if unit_keys:
        k = k / math.sqrt(key_dim)
    decay_rate = torch.rand(value_heads, dtype=torch.float64) * decay_scale + 0.05
    inputs = {
        "q": q,
        "k": k,
        "v": torch.randn(batch, seq_len, value_heads, value_dim, dtype=torch.float64),
        "g": -decay_rate * F.softplus(torch.randn(batch, seq_len, value_heads).double() - 1),
        "beta": torch.sigmoid(torch.randn(batch, seq_len, value_heads, dtype=torch.float64)),
    }
    if initial_state:
        n = batch if n_seq is None else n_seq
        inputs["h0"] = 0.5 * torch.randn(n, value_heads, key_dim, value_dim, dtype=torch.float64)
    return inputs


def with_state(fn, **fixed):
    """``fn`` with the initial state as argument ``h0`` and (o, final state) as the result."""

    def run(q, k, v, g, beta, h0=None, **kwargs):
        return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **fixed, **kwargs)

    return run


def run_check(inputs, dtype, algo, **kw):
    autocast = kw.get("autocast")
    fixed = kw.pop("fixed", {})
    return check_op(
        with_state(fusetune.gated_delta_rule, mode=algo, **fixed),
        with_state(reference_op, **fixed),
        inputs,
        dtype=dtype,
        cast=list(inputs),
        grad=list(inputs),
        output_dtypes=[autocast or dtype, torch.float32],
        **kw,
    )


# ----------------------------------------------------------------------------- the oracle


def layer_repeats_key_heads(modeling) -> bool:
    """Whether the installed Qwen3.5 layer repeats q/k heads up to the value heads before it
    calls the delta rule (transformers 5.17 does; 5.23's functions take grouped heads and
    repeat inside): the test gives the function what its own layer gives it."""
    return "repeat_interleave" in inspect.getsource(modeling.Qwen3_5GatedDeltaNet.forward)


@pytest.mark.parametrize(
    "name", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"]
)
def test_reference_matches_transformers(name):
    """The reference, written from the paper, against transformers' own Qwen3.5 functions (fp32;
    grouped value heads, l2norm, initial and final state)."""
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    x = make_inputs(batch=2, seq_len=70, key_heads=2, value_heads=4, unit_keys=False)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    theirs = [a.float() for a in args]
    if layer_repeats_key_heads(modeling):  # transformers <= 5.17: the function wants HK = HV
        theirs[:2] = (a.repeat_interleave(2, dim=2) for a in theirs[:2])
    want, want_state = getattr(modeling, name)(
        *theirs,
        initial_state=x["h0"].float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    got, state = reference_op(
        *args, initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert got.dtype == state.dtype == torch.float64
    assert_close("o", want, got, 1e-5)
    assert_close("final state", want_state, state, 1e-5)


# ----------------------------------------------------------------------------- the kernels


@matrix()
def test_matrix(dtype, autocast, mode, layout):
    """Output, final state and every gradient (q, k, v, g, beta, initial state) of chunk mode
    (the training path), with grouped value heads, sizes that pad every block (K = 12, V = 20)
    and two chunks (16 tokens a chunk under the interpreter)."""
    assert uses_kernels(torch.empty(0, dtype=dtype, device=DEVICE))
    inputs = make_inputs(batch=1, seq_len=19)
    run_check(inputs, dtype, "chunk", mode=mode, autocast=autocast, layout=layout)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_recurrent_dtypes(dtype, mode):
    """The recurrent kernels (decoding) in every dtype, eager and compiled."""
    inputs = make_inputs(batch=2, seq_len=8)
    run_check(inputs, dtype, "recurrent", mode=mode, layout="noncontiguous")


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_l2norm_and_groups(algo, dtype):
    """use_qk_l2norm_in_kernel on raw keys (the models' call), two key heads serving four value
    heads, an explicit scale."""
    inputs = make_inputs(batch=1, seq_len=20, key_heads=2, value_heads=4, unit_keys=False)
    fixed = dict(use_qk_l2norm_in_kernel=True, scale=0.4)
    run_check(inputs, dtype, algo, fixed=fixed)


@pytest.mark.parametrize("algo", ALGOS)
def test_several_value_blocks(monkeypatch, algo):
    """V = 40 in blocks of 16 (three programs a head, the last one partial): the per-block
    partial sums of dq, dk, dbeta and dg add up (both modes); the chunk states and outputs
    walk each block alone."""
    monkeypatch.setattr(gdr_recurrent, "MAX_BV_INTERPRET", 16)
    monkeypatch.setattr(gdr_chunk, "BWD_BLOCK_V", 16)
    inputs = make_inputs(
        batch=1, seq_len=10 if algo == "recurrent" else 20, key_dim=32, value_dim=40
    )
    run_check(inputs, torch.float32, algo)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunks_of_64(monkeypatch, dtype):
    """The GPU's chunk size under the interpreter: (I + A)^-1 from four 16-row blocks (the
    blocked inverse and its N^2, N^3 terms), 70 tokens = a full chunk and a partial one."""
    monkeypatch.setattr(gdr_chunk, "INTERPRET_CHUNK", 64)
    inputs = make_inputs(batch=1, seq_len=70, unit_keys=False)
    run_check(inputs, dtype, "chunk", fixed=dict(use_qk_l2norm_in_kernel=True))


@pytest.mark.parametrize("chunk,seq_len", [(16, 20), (32, 40), (64, 100)])
def test_inverse_kernel_blocks(chunk, seq_len):
    """inverse_kernel's T = (I + A)^-1 against float64's inverse for one, two and four 16-token
    blocks a chunk (full and partial chunks, grouped heads, a -5000 gate inside a chunk): the
    blocked substitution and its IEEE block products hold fp32's accuracy (rows past a
    sequence's end are never written)."""
    x = make_inputs(batch=2, seq_len=seq_len, key_heads=1, value_heads=2, key_dim=24,
                    unit_keys=False)  # fmt: skip
    x["g"][1, 5, 0] = -5000.0
    k, g, beta = (x[n].float().to(DEVICE) for n in ("k", "g", "beta"))
    batch, _, heads = g.shape
    chunks = -(-seq_len // chunk)
    t_buf = torch.full((batch, seq_len, heads, chunk), float("nan"), device=DEVICE)
    gdr_chunk.inverse_kernel[(chunks, batch * heads)](
        k, g, beta, t_buf, t_buf, *k.stride()[:3], *g.stride(), *beta.stride(), seq_len, heads, 0,
        GROUP=2, K=24, BT=chunk, VARLEN=False, DOT=gdr_chunk.DOT_MODES["split3"],
        L2NORM=True, num_warps=1,
    )  # fmt: skip
    kn = F.normalize(x["k"], dim=-1)
    for c in range(chunks):
        span = slice(c * chunk, min((c + 1) * chunk, seq_len))
        n = span.stop - span.start
        kc = kn[:, span, 0]  # [B, n, K]
        cum = x["g"][:, span].clamp(min=-1e4).cumsum(1)  # [B, n, H]
        decay = torch.exp(cum[:, :, None] - cum[:, None, :]).permute(0, 3, 1, 2).tril(-1)
        a = x["beta"][:, span].permute(0, 2, 1)[..., None] * (kc @ kc.mT)[:, None] * decay
        exact = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + a)  # [B, H, n, n]
        got = t_buf[:, span].permute(0, 2, 1, 3)[..., :n].double().cpu()
        error = ((got - exact).abs().amax() / exact.abs().amax()).item()
        assert error < 1e-6, f"T of chunk {c}: max error {error:.2e} of max |T|"


@pytest.mark.parametrize("algo", ALGOS)
def test_extreme_gates(algo):
    """Gates of -30, -5000 (a chunk cumsum past -5000, where G_t - G_s would keep only 5e-4 of
    the decays after it), -1e4 and -inf (a full reset) amid mild ones: finite and exact in
    fp32, dg included."""
    inputs = make_inputs(batch=1, seq_len=36)
    g = inputs["g"]
    g[:, 2] = -5000.0
    g[:, 7] = -30.0
    g[:, 19, 0] = -1e4
    g[:, 25, 1] = -float("inf")
    result = run_check(inputs, torch.float32, algo)
    assert all(torch.isfinite(x).all() for x in result.outputs)
    assert all(torch.isfinite(x).all() for x in result.grads.values())


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize(
    "dtype,cu_dtype",
    [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)],
    ids=["fp32-i64", "bf16-i32"],
)
def test_varlen_matches_per_sequence_runs(algo, dtype, cu_dtype):
    """Packed sequences (one empty, one of a single token) give what each gives alone: no state
    crosses a boundary; one initial and one final state per sequence."""
    offsets = [0, 5, 5, 17, 18, 30]
    inputs = make_inputs(batch=1, seq_len=offsets[-1], n_seq=len(offsets) - 1)
    check_packed(inputs, offsets, dtype, cu_dtype, mode=algo)


def check_packed(inputs, offsets, dtype, cu_dtype=torch.int64, **options):
    """fusetune on packed sequences (``options``: e.g. mode) against the oracle run on each
    sequence alone, in ``dtype``; states in fp32."""
    cu = torch.tensor(offsets, dtype=cu_dtype, device=DEVICE)
    check_op(
        with_state(fusetune.gated_delta_rule, cu_seqlens=cu, **options),
        per_sequence(with_state(reference_op), offsets, ("h0",)),
        inputs,
        dtype=dtype,
        cast=list(inputs),
        grad=list(inputs),
        output_dtypes=[dtype, torch.float32],
    )


@pytest.mark.parametrize("algo", ALGOS)
def test_decoding_single_token(algo):
    """T = 1 with a carried state: one decoding step."""
    inputs = make_inputs(batch=3, seq_len=1)
    run_check(inputs, torch.bfloat16, algo)


@pytest.mark.parametrize("algo", ALGOS)
def test_plain_call(algo):
    """No initial state, no final state: o and None; gradients for q, k, v, g, beta."""
    inputs = make_inputs(batch=1, seq_len=9, initial_state=False)

    def drop_state(fn):
        def run(**kw):
            o, state = fn(**kw)
            assert state is None
            return o

        return run

    check_op(
        drop_state(lambda **kw: fusetune.gated_delta_rule(**kw, mode=algo)),
        drop_state(reference_op),
        inputs,
        dtype=torch.float16,
        cast=list(inputs),
        grad=list(inputs),
    )


def test_fp32_gates_beside_bf16_inputs():
    """The models' mix: bf16 q, k, v and beta, fp32 g; each gradient in its input's dtype."""
    inputs = make_inputs(batch=1, seq_len=11)
    run_check(
        inputs, torch.bfloat16, "chunk", input_dtypes={"g": torch.float32, "h0": torch.float32}
    )


# ----------------------------------------------------------------------------- split products
# FUSETUNE_GDR_DOT: tensor-core products by default (split3 for fp32 and fp16: 16-bit inputs as
# they are, fp32 operands split into two tf32 halves, gdr_chunk.mm; tf32 for bf16); ieee runs
# IEEE fp32 FMA, kept as a second path to check against. The tests below run the mode the rest
# of the file does not (ieee) on the small shapes, and the split helpers themselves. Triton's
# own "tf32x3" lowering and 16-wide tensor-core tiles faulted (illegal memory access) under
# Triton 3.6 on these small shapes: they run here on the CPU and again, compiled, in the GPU
# pass.
OTHER_MODES = ["ieee"]


@triton.jit
def _tf32_halves_kernel(x, hi, lo, N: tl.constexpr):
    cols = tl.arange(0, N)
    high, low = gdr_chunk.tf32_split(tl.load(x + cols))
    tl.store(hi + cols, high)
    tl.store(lo + cols, low)


@triton.jit
def _mm_kernel(a, b, c, DOT: tl.constexpr, N: tl.constexpr, PAIR: tl.constexpr = False):
    r = tl.arange(0, N)
    tile = r[:, None] * N + r[None, :]
    if PAIR:
        tl.store(c + tile, gdr_chunk.mm_pair(tl.load(a + tile), tl.load(b + tile), DOT))
    else:
        tl.store(c + tile, gdr_chunk.mm(tl.load(a + tile), tl.load(b + tile), DOT))


def test_tf32_split():
    """hi is a tf32 value (13 low bits clear) and hi + (x - hi) == x bitwise (the split loses
    nothing); lo is tf32 as well and hi + lo is x within 2^-23 relative. Values of every scale,
    both signs, mantissas of all ones (rounding carries into the exponent), zero, subnormals."""
    torch.manual_seed(0)
    x = torch.randn(256) * torch.exp2(torch.randint(-60, 60, (256,)).float())
    x[:4] = torch.tensor([0.0, 1.9999999, -1.9999999, 1e-40])
    x = x.to(DEVICE)
    hi, lo = torch.empty_like(x), torch.empty_like(x)
    _tf32_halves_kernel[(1,)](x, hi, lo, N=256)
    low_bits = 0x1FFF
    assert (hi.view(torch.int32) & low_bits).eq(0).all()
    assert (lo.view(torch.int32) & low_bits).eq(0).all()
    assert torch.equal(hi + (x - hi), x)
    assert hi[1].item() == 2.0 and hi[2].item() == -2.0  # the carry
    x64 = x.double()
    normal = x64.abs() >= 2.0**-126  # subnormals: absolute, half a tf32 unit (2^-136)
    size = x64.abs()[normal]
    assert ((x64 - hi.double()).abs()[normal] <= 2.0**-11 * size).all()
    rest = (x64 - hi.double() - lo.double()).abs()
    assert (rest[normal] <= 2.0**-23 * size).all()
    assert (rest[~normal] <= 2.0**-137).all()


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float16, torch.bfloat16),
    ],
    ids=["fp32-fp32", "fp32-bf16", "bf16-fp32", "bf16-bf16", "fp16-fp16", "fp16-bf16"],
)
def test_split_products(dtypes):
    """gdr_chunk.mm in split3 mode against float64 for every operand pairing the
    kernels use: within 2^-20 of |a| |b| (fp32 rounding and accumulation; one tf32 product would
    be 2^-11)."""
    torch.manual_seed(1)
    n = 32
    a, b = (
        (torch.randn(n, n) * torch.exp2(torch.randint(-8, 8, (n, n)).float())).to(dt)
        for dt in dtypes
    )
    c = torch.empty(n, n, device=DEVICE)
    _mm_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), c, DOT=gdr_chunk.DOT_MODES["split3"], N=n)
    want = a.double() @ b.double()
    bound = 2.0**-20 * (a.double().abs() @ b.double().abs())
    assert ((c.cpu().double() - want).abs() <= bound).all()


def test_tf32_products():
    """gdr_chunk.mm in tf32 mode (bf16's default): an fp32 operand is read as tf32, within 2^-9
    of |a| |b| (truncation of both operands: 2^-10 each) and not fp32-exact, on the GPU's
    tensor cores and in the interpreter, which drops the low bits itself (EMULATE_TF32) so that
    the CPU tests see this mode's rounding; two bf16 tiles keep their exact product."""
    torch.manual_seed(2)
    n = 32
    a = torch.randn(n, n) * torch.exp2(torch.randint(-8, 8, (n, n)).float())
    b16 = torch.randn(n, n).bfloat16()
    for b in (a.T.contiguous(), b16):
        c = torch.empty(n, n, device=DEVICE)
        _mm_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), c, DOT=gdr_chunk.DOT_MODES["tf32"], N=n)
        want = a.double() @ b.double()
        magnitude = a.double().abs() @ b.double().abs()
        error = (c.cpu().double() - want).abs()
        assert (error <= 2.0**-9 * magnitude).all()
        assert (error > 2.0**-18 * magnitude).any()
    exact = torch.empty(n, n, device=DEVICE)
    a16 = a.bfloat16()
    _mm_kernel[(1,)](a16.to(DEVICE), b16.to(DEVICE), exact, DOT=gdr_chunk.DOT_MODES["tf32"], N=n)
    want = a16.double() @ b16.double()
    assert (
        (exact.cpu().double() - want).abs() <= 2.0**-20 * (a16.double().abs() @ b16.double().abs())
    ).all()


def test_bf16_pair_products():
    """gdr_chunk.mm_pair (wy_kernel's products) in tf32 mode: an fp32 tile beside a bf16 one is
    a bf16 hi + lo pair, within 2^-16 of |a| |b| on either side and for a narrow B operand
    (the transposed form); two fp32 tiles keep tf32's product (coarser than 2^-18 somewhere)."""
    torch.manual_seed(3)
    tf32 = gdr_chunk.DOT_MODES["tf32"]
    for n in (32, 64):
        a = torch.randn(n, n) * torch.exp2(torch.randint(-8, 8, (n, n)).float())
        b16 = (torch.randn(n, n) * torch.exp2(torch.randint(-4, 4, (n, n)).float())).bfloat16()
        for left, right in ((a, b16), (b16, a)):
            c = torch.empty(n, n, device=DEVICE)
            _mm_kernel[(1,)](left.to(DEVICE), right.to(DEVICE), c, DOT=tf32, N=n, PAIR=True)
            want = left.double() @ right.double()
            magnitude = left.double().abs() @ right.double().abs()
            assert ((c.cpu().double() - want).abs() <= 2.0**-16 * magnitude).all()
    c = torch.empty(n, n, device=DEVICE)
    _mm_kernel[(1,)](a.to(DEVICE), a.T.contiguous().to(DEVICE), c, DOT=tf32, N=n, PAIR=True)
    error = (c.cpu().double() - a.double() @ a.T.double()).abs()
    assert (error > 2.0**-18 * (a.double().abs() @ a.T.double().abs())).any()


def test_dot_mode_names(monkeypatch):
    """By default bf16 inputs take tf32 products where the GPU holds their tiles, fp16 and fp32
    split3; the variable forces one."""
    monkeypatch.delenv("FUSETUNE_GDR_DOT", raising=False)
    modes = {dtype: gdr_chunk.dot_mode(dtype) for dtype in (torch.float32, torch.float16)}
    assert modes == {torch.float32: 3, torch.float16: 3}
    assert gdr_chunk.dot_mode(torch.bfloat16) == 4
    assert gdr_chunk.dot_mode(torch.bfloat16, 232448) == 4  # H100, H200
    assert gdr_chunk.dot_mode(torch.bfloat16, 166912) == 4  # A100
    assert gdr_chunk.dot_mode(torch.bfloat16, 101376) == 3  # consumer parts: tf32 does not fit
    monkeypatch.setenv("FUSETUNE_GDR_DOT", "ieee")
    assert gdr_chunk.dot_mode(torch.bfloat16) == 2
    monkeypatch.setenv("FUSETUNE_GDR_DOT", "bf16")
    assert gdr_chunk.dot_mode(torch.bfloat16) == gdr_chunk.dot_mode(torch.bfloat16, 101376) == 5
    for refused in ("tf32x3", "bf16x6"):
        monkeypatch.setenv("FUSETUNE_GDR_DOT", refused)
        match = rf"FUSETUNE_GDR_DOT must be .*'tf32', 'bf16'\), got '{refused}'"
        with pytest.raises(ValueError, match=match):
            gdr_chunk.dot_mode(torch.float32)


def bf16_run_allocations(monkeypatch, **shape) -> tuple[list, bool]:
    """A bf16 forward and backward of one sequence (``make_inputs`` sizes): the (shape, dtype)
    of every buffer ``fusetune._utils.empty`` allocated, and whether the kernels ran."""
    inputs = make_inputs(batch=1, initial_state=False, **shape)
    leaves = [inputs[n].to(DEVICE, torch.bfloat16).requires_grad_() for n in ("q", "k", "v")]
    g, beta = (inputs[n].to(DEVICE, torch.bfloat16) for n in ("g", "beta"))
    allocated = []
    empty = fusetune._utils.empty
    monkeypatch.setattr(fusetune._utils, "empty",
                        lambda size, dtype, device: allocated.append((tuple(size), dtype))
                        or empty(size, dtype, device))  # fmt: skip
    o, _ = fusetune.gated_delta_rule(*leaves, g, beta)
    o.float().sum().backward()
    return allocated, uses_kernels(leaves[0])


def test_state_copies_are_bf16_for_bf16_inputs_only(monkeypatch):
    """The per-chunk copies of S0 and dS (the sequential kernels carry fp32) are bf16 for bf16
    inputs with tf32 products, fp32 otherwise; a bf16 run allocates them so (their accuracy:
    the matrix tests, within bf16's tolerance)."""
    tf32, split3, ieee = (gdr_chunk.DOT_MODES[mode] for mode in ("tf32", "split3", "ieee"))
    assert gdr_chunk.state_dtype(torch.bfloat16, tf32) == torch.bfloat16
    for dtype, dot in ((torch.bfloat16, split3), (torch.bfloat16, ieee),
                       (torch.float16, split3), (torch.float32, tf32)):  # fmt: skip
        assert gdr_chunk.state_dtype(dtype, dot) == torch.float32
    monkeypatch.delenv("FUSETUNE_GDR_DOT", raising=False)
    allocated, uses = bf16_run_allocations(monkeypatch, seq_len=130, key_dim=16, value_dim=16)
    # [chunks, heads, K, V]: the forward's S0, the backward's S0 and dS (dh0 is [1, ...])
    states = [dtype for shape, dtype in allocated if shape[1:] == (2, 16, 16) and shape[0] > 1]
    assert states == ([torch.bfloat16] * 3 if uses else []), allocated


def test_sequential_products_bf16_for_bf16_inputs_only(monkeypatch):
    """W and the sequential kernels' products are bf16 for bf16 inputs with tf32 products (level
    2), as before (fp32 W, level 0) otherwise; FUSETUNE_GDR_W=w keeps bf16 only for W and its
    products, fp32 restores the old path, anything else is refused. A bf16 run allocates w_buf
    [B, T, HV, K] so (its accuracy: the matrix tests; the other levels: below)."""
    tf32, split3 = gdr_chunk.DOT_MODES["tf32"], gdr_chunk.DOT_MODES["split3"]
    monkeypatch.delenv("FUSETUNE_GDR_W", raising=False)
    assert gdr_chunk.sequential_bf16(torch.bfloat16, tf32) == 2
    for dtype, dot in ((torch.bfloat16, split3), (torch.float16, split3), (torch.float32, tf32)):
        assert gdr_chunk.sequential_bf16(dtype, dot) == 0
    levels = {"w": 1, "fp32": 0, "auto": 2, "d": 3}
    for mode, level in levels.items():
        monkeypatch.setenv("FUSETUNE_GDR_W", mode)
        assert gdr_chunk.sequential_bf16(torch.bfloat16, tf32) == level
        assert gdr_chunk.sequential_bf16(torch.float16, split3) == 0
    monkeypatch.setenv("FUSETUNE_GDR_W", "bf16")
    with pytest.raises(ValueError, match=r"FUSETUNE_GDR_W must be one of .*'d'\), got 'bf16'"):
        gdr_chunk.sequential_bf16(torch.bfloat16, tf32)
    monkeypatch.delenv("FUSETUNE_GDR_W")
    monkeypatch.delenv("FUSETUNE_GDR_DOT", raising=False)
    allocated, uses = bf16_run_allocations(monkeypatch, seq_len=40, key_dim=32, value_dim=24)
    # [1, T, HV, K]: w_buf in the forward and the backward, dq and dk per value head (fp32)
    w_bufs = [dtype for shape, dtype in allocated if shape == (1, 40, 2, 32)]
    want = [torch.bfloat16] * 2 + [torch.float32] * 2 if uses else []
    assert sorted(w_bufs, key=str) == want, allocated


@pytest.mark.parametrize(
    "dot,level", [("auto", "w"), ("auto", "fp32"), ("auto", "d"), ("bf16", "auto"), ("bf16", "d")]
)
def test_sequential_products_levels(monkeypatch, dot, level):
    """FUSETUNE_GDR_W's other levels (kept for timing; d: bf16 writes D) and the opt-in bf16
    products (FUSETUNE_GDR_DOT=bf16, FLA's precision) within bf16's tolerance: grouped heads,
    l2norm, several chunks and value blocks, an initial state."""
    monkeypatch.setenv("FUSETUNE_GDR_DOT", dot)
    monkeypatch.setenv("FUSETUNE_GDR_W", level)
    monkeypatch.setattr(gdr_chunk, "BWD_BLOCK_V", 16)
    inputs = make_inputs(batch=1, seq_len=40, key_heads=2, value_heads=4, key_dim=32,
                         value_dim=40, unit_keys=False)  # fmt: skip
    run_check(inputs, torch.bfloat16, "chunk", fixed=dict(use_qk_l2norm_in_kernel=True))


class LaunchSpy:
    """A chunk kernel that records each launch's DOT, SEQ_BF16 and d_buf dtype (where it has
    them) into ``seen`` before launching."""

    def __init__(self, name, seen) -> None:
        self.name, self.seen, self.kernel = name, seen, getattr(gdr_chunk, name)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            names = self.kernel.arg_names
            d_buf = args[names.index("d_buf")].dtype if "d_buf" in names else None
            self.seen.append((self.name, kwargs["DOT"], kwargs.get("SEQ_BF16"), d_buf))
            return launch(*args, **kwargs)

        return run


CHUNK_KERNELS = ("inverse_kernel", "wy_kernel", "states_kernel", "output_kernel",
                 "dstates_kernel", "bwd_pairs_kernel", "bwd_chunk_kernel")  # fmt: skip


@pytest.mark.parametrize("dot,level", [("auto", "auto"), ("bf16", "auto"), ("auto", "d"),
                                       ("bf16", "d")])  # fmt: skip
def test_bf16_modes_reach_the_kernels(monkeypatch, dot, level):
    """FUSETUNE_GDR_DOT=bf16 and FUSETUNE_GDR_W=d, read at every call, reach what a bf16
    forward and backward launch: every chunk kernel gets DOT 5 (4, tf32, by default); with W=d
    the sequential kernels get level 3 and the writes D a bf16 buffer, read by output_kernel
    and both backward per-chunk kernels (fp32 by default)."""
    seen = []
    for name in CHUNK_KERNELS:
        monkeypatch.setattr(gdr_chunk, name, LaunchSpy(name, seen))
    monkeypatch.setenv("FUSETUNE_GDR_DOT", dot)
    monkeypatch.setenv("FUSETUNE_GDR_W", level)
    _, uses = bf16_run_allocations(monkeypatch, seq_len=40, key_dim=32, value_dim=24)
    if not uses:
        assert seen == []
        return
    assert sorted({name for name, *_ in seen}) == sorted(CHUNK_KERNELS)
    assert {dot_ for _, dot_, _, _ in seen} == {5 if dot == "bf16" else 4}
    assert {seq for _, _, seq, _ in seen if seq is not None} == {3 if level == "d" else 2}
    d_dtypes = {d for _, _, _, d in seen if d is not None}
    assert d_dtypes == {torch.bfloat16 if level == "d" else torch.float32}


def test_bad_modes_named_by_the_op(monkeypatch):
    """A bad FUSETUNE_GDR_DOT or FUSETUNE_GDR_W value fails the call itself with a ValueError
    naming the variable (both are read at every call, not at import)."""
    inputs = make_inputs(batch=1, seq_len=5, initial_state=False)
    args = [inputs[n].to(DEVICE, torch.bfloat16) for n in ("q", "k", "v", "g", "beta")]
    if not uses_kernels(args[0]):
        pytest.skip("the reference path reads neither variable")
    for name in ("FUSETUNE_GDR_DOT", "FUSETUNE_GDR_W"):
        with monkeypatch.context() as env:
            env.setenv(name, "bf8")
            with pytest.raises(ValueError, match=rf"{name} must be .*got 'bf8'"):
                fusetune.gated_delta_rule(*args)


@triton.jit
def _decays_kernel(g, decays, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(decays + r[:, None] * N + r[None, :], gdr_chunk._decays(tl.load(g + r), r, False))


def test_decays_keep_fp32_accuracy():
    """The chunk's decays exp(g_{s+1} + ... + g_t) from the double-fp32 cumsum: within a few
    fp32 units of float64 behind gates of -5000 and -1e4 (the cumsum's fp32 heads round off
    about 1e-4 there, a plain G_t - G_s decay would be off by as much)."""
    torch.manual_seed(3)
    g = -torch.rand(64, dtype=torch.float64) * 3
    g[5], g[30] = -5000.0, -1e4
    decays = torch.empty(64, 64, device=DEVICE)
    _decays_kernel[(1,)](g.float().to(DEVICE), decays, N=64)
    cum = g.float().double().cumsum(0)
    exact = torch.exp(cum[:, None] - cum[None, :]).tril()
    # (decays above 1e-3, spans above -7: the GPU's exp, 2^(x log2 e), adds about |x| 2^-24)
    kept = exact > 1e-3
    error = ((decays.cpu().double() - exact).abs() / exact)[kept].amax().item()
    assert error < 2e-6, f"decays: max relative error {error:.2e}"


def test_bf16_products():
    """FUSETUNE_GDR_DOT=bf16's product (mode 5): each fp32 operand rounded to the nearest bf16
    (torch's rounding) and the sum exact to fp32 accumulation, for fp32 with fp32 and with a
    bf16 input tile (tf32 mode, 2 more mantissa bits, fails this); two bf16 tiles keep their
    exact product. ((I + A)^-1 and the decays take no product in any mode:
    test_inverse_kernel_blocks, test_decays_keep_fp32_accuracy.)"""
    torch.manual_seed(3)
    n = 32
    a = torch.randn(n, n) * torch.exp2(torch.randint(-8, 8, (n, n)).float())
    b16 = torch.randn(n, n).bfloat16()
    for x, y in ((a, a.T.contiguous()), (a, b16), (a.bfloat16(), b16)):
        rounded = x.bfloat16().double() @ y.bfloat16().double()
        bound = 2.0**-20 * (x.double().abs() @ y.double().abs())
        for dot in (5, 4):
            c = torch.empty(n, n, device=DEVICE)
            _mm_kernel[(1,)](x.to(DEVICE), y.to(DEVICE), c, DOT=dot, N=n)
            within = ((c.cpu().double() - rounded).abs() <= bound).all()
            assert within == (dot == 5 or x.dtype == torch.bfloat16), (dot, x.dtype, y.dtype)


def test_backward_side_stream_modes(monkeypatch):
    """FUSETUNE_GDR_BWD_SEQ: its names checked; off CUDA always one stream."""
    for mode in ("auto", "beside", "apart"):
        monkeypatch.setenv("FUSETUNE_GDR_BWD_SEQ", mode)
        assert gdr_chunk.backward_side_stream(torch.device("cpu"), 2) is None
    monkeypatch.setenv("FUSETUNE_GDR_BWD_SEQ", "side")
    with pytest.raises(ValueError, match=r"FUSETUNE_GDR_BWD_SEQ must be .*got 'side'"):
        gdr_chunk.backward_side_stream(torch.device("cpu"), 2)


@pytest.mark.skipif(not ON_GPU, reason="GPU pass only: CUDA streams")
def test_backward_beside_equals_apart(monkeypatch):
    """The backward's states recompute on a side stream beside dstates gives bit for bit what
    one stream gives (bf16, l2norm, grouped heads, an initial state, packed sequences)."""
    torch.manual_seed(0)
    q, k = (torch.randn(1, 900, 2, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 900, 4, 128, device=DEVICE, dtype=torch.bfloat16)
    g = -F.softplus(torch.randn(1, 900, 4, device=DEVICE))
    beta = torch.rand(1, 900, 4, device=DEVICE, dtype=torch.bfloat16)
    h0 = torch.randn(3, 4, 128, 128, device=DEVICE)
    cu = torch.tensor([0, 300, 301, 900], device=DEVICE)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    grad_out = torch.randn_like(v)
    results = {}
    for mode in ("apart", "beside"):
        monkeypatch.setenv("FUSETUNE_GDR_BWD_SEQ", mode)
        o, _ = fusetune.gated_delta_rule(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu,
                                         use_qk_l2norm_in_kernel=True)  # fmt: skip
        results[mode] = torch.autograd.grad(o, leaves, grad_out)
    for apart, beside in zip(results["apart"], results["beside"], strict=True):
        assert torch.equal(apart, beside)


def test_forward_parts_modes(monkeypatch):
    """FUSETUNE_GDR_FWD_PARTS: auto splits in two where the walk's programs leave half the SMs
    idle (the interpreter counts 4); a number is taken as asked, in whole multiples of 16 chunks on
    a GPU (fewer parts where the chunks are too few); other values are refused by name."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    parts = gdr_chunk.forward_parts
    monkeypatch.setenv("FUSETUNE_GDR_FWD_PARTS", "auto")
    assert parts(cpu, 2, 8) == [(0, 4), (4, 8)]
    assert parts(cpu, 3, 8) == [(0, 8)]
    monkeypatch.setenv("FUSETUNE_GDR_FWD_PARTS", "4")
    assert parts(cuda, 64, 512) == [(0, 128), (128, 256), (256, 384), (384, 512)]
    assert parts(cuda, 64, 40) == [(0, 32), (32, 40)]
    assert parts(cuda, 64, 15) == [(0, 15)]
    assert parts(cpu, 64, 5) == [(0, 2), (2, 4), (4, 5)]
    monkeypatch.setenv("FUSETUNE_GDR_FWD_PARTS", "0")
    with pytest.raises(ValueError, match=r"FUSETUNE_GDR_FWD_PARTS must be .*got '0'"):
        parts(cpu, 2, 8)


def _bf16_inputs(length: int, n_seq: int) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta, h0) in bf16 (g and h0 fp32): one key head and two value heads of 32,
    ``length`` tokens, an initial state for each of ``n_seq`` packed sequences."""
    q, k = (torch.randn(1, length, 1, 32, device=DEVICE, dtype=torch.bfloat16) for _ in "qk")
    v = torch.randn(1, length, 2, 32, device=DEVICE, dtype=torch.bfloat16)
    g = -F.softplus(torch.randn(1, length, 2, device=DEVICE))
    beta = torch.rand(1, length, 2, device=DEVICE, dtype=torch.bfloat16)
    return q, k, v, g, beta, torch.randn(n_seq, 2, 32, 32, device=DEVICE)


def test_forward_parts_equal_one_part(monkeypatch):
    """The forward walked in parts (on a side stream on the GPU) gives bit for bit what one
    part gives: the state crosses the parts in fp32 (bf16, l2norm, grouped heads, an initial
    and a final state, packed sequences of which one ends inside the first part)."""
    torch.manual_seed(0)
    length = 4100 if ON_GPU else 40  # (3 parts: 65 chunks of 64, or 3 of 16)
    q, k, v, g, beta, h0 = _bf16_inputs(length, 3)
    cu = torch.tensor([0, length // 5, length // 5 + 1, length], device=DEVICE)
    results = {}
    for count in ("1", "3"):
        monkeypatch.setenv("FUSETUNE_GDR_FWD_PARTS", count)
        results[count] = fusetune.gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                   output_final_state=True, cu_seqlens=cu,
                                                   use_qk_l2norm_in_kernel=True)  # fmt: skip
    for one, parts in zip(results["1"], results["3"], strict=True):
        assert torch.equal(one, parts)


class _CountedLaunches:
    """A kernel whose launches (``kernel[grid](...)``) are counted."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def test_backward_reads_the_forwards_t(monkeypatch):
    """The backward takes T = (I + A)^-1 as the forward left it (no second inverse_kernel
    launch) and leaves it as it found it: a second backward through the same graph gives bit for
    bit the first's gradients (packed sequences, l2norm, an initial state)."""
    torch.manual_seed(0)
    leaves = [x.requires_grad_() for x in _bf16_inputs(40, 2)]
    inverse = _CountedLaunches(gdr_chunk.inverse_kernel)
    monkeypatch.setattr(gdr_chunk, "inverse_kernel", inverse)
    monkeypatch.setenv("FUSETUNE_GDR_FWD_PARTS", "1")
    o, _ = fusetune.gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                     cu_seqlens=torch.tensor([0, 17, 40], device=DEVICE),
                                     use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert inverse.count == 1
    grad_out = torch.randn_like(o)
    first = torch.autograd.grad(o, leaves, grad_out, retain_graph=True)
    second = torch.autograd.grad(o, leaves, grad_out)
    assert inverse.count == 1
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


SPLIT_CASES = {
    # name: (make_inputs arguments, dtype, options)
    "matrix-fp32": (dict(batch=1, seq_len=19), torch.float32, {}),
    "matrix-fp16": (dict(batch=1, seq_len=19), torch.float16, {}),
    "matrix-bf16": (dict(batch=1, seq_len=19), torch.bfloat16, dict(layout="noncontiguous")),
    "l2norm-groups-bf16": (
        dict(batch=1, seq_len=20, key_heads=2, value_heads=4, unit_keys=False),
        torch.bfloat16,
        dict(fixed=dict(use_qk_l2norm_in_kernel=True, scale=0.4)),
    ),
    "value-blocks-fp32": (dict(batch=1, seq_len=20, key_dim=32, value_dim=40), torch.float32, {}),
    "single-token-bf16": (dict(batch=3, seq_len=1), torch.bfloat16, {}),
}


@pytest.mark.parametrize("mode", OTHER_MODES)
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_other_mode_small_shapes(monkeypatch, mode, case):
    """Chunk mode with IEEE products on the test matrix's small shapes (padded K = 12,
    V = 20; grouped heads; several value blocks; T = 1), every output and gradient."""
    monkeypatch.setenv("FUSETUNE_GDR_DOT", mode)
    if case == "value-blocks-fp32":
        monkeypatch.setattr(gdr_chunk, "BWD_BLOCK_V", 16)
    shape, dtype, options = SPLIT_CASES[case]
    run_check(make_inputs(**shape), dtype, "chunk", **options)


@pytest.mark.parametrize("mode", OTHER_MODES)
def test_other_mode_varlen(monkeypatch, mode):
    """Packed sequences (one empty, one of a single token) with IEEE products, bf16."""
    monkeypatch.setenv("FUSETUNE_GDR_DOT", mode)
    offsets = [0, 5, 5, 17, 18, 30]
    inputs = make_inputs(batch=1, seq_len=offsets[-1], n_seq=len(offsets) - 1)
    check_packed(inputs, offsets, torch.bfloat16, torch.int32)


# tf32 products are bf16's mode: fp32 inputs through them would miss fp32's 5e-5 (2e-3 on o).
MODE_DTYPES = {
    "ieee": torch.float32,
    "split3": torch.float32,
    "tf32": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@pytest.mark.parametrize("mode", list(gdr_chunk.DOT_MODES))
def test_chunks_of_64_extreme_gates(monkeypatch, mode):
    """Every product mode with 64-token chunks (the blocked inverse's N^2, N^3 terms through
    them) and gates of -5000, -1e4 and -inf: within its dtype's tolerance (fp32 for the exact
    modes, bf16 for tf32), dg included."""
    monkeypatch.setenv("FUSETUNE_GDR_DOT", mode)
    monkeypatch.setattr(gdr_chunk, "INTERPRET_CHUNK", 64)
    inputs = make_inputs(batch=1, seq_len=70, unit_keys=False)
    inputs["g"][:, 2] = -5000.0
    inputs["g"][:, 40, 0] = -1e4
    inputs["g"][:, 50, 1] = -float("inf")
    fixed = dict(use_qk_l2norm_in_kernel=True)
    result = run_check(inputs, MODE_DTYPES[mode], "chunk", fixed=fixed)
    assert all(torch.isfinite(x).all() for x in result.grads.values())


@pytest.mark.skipif(not ON_GPU, reason="GPU pass only: T = 1024, K = V = 128")
@pytest.mark.parametrize(
    "mode,dtype,l2norm",
    [
        ("split3", torch.bfloat16, True),
        ("split3", torch.bfloat16, False),
        ("split3", torch.float32, False),
    ],
    ids=["split3-bf16-l2norm", "split3-bf16", "split3-fp32"],
)
def test_split_long_gpu(monkeypatch, mode, dtype, l2norm):
    """Split products at B2 T1024, four value heads on two key heads, K = V = 128: with l2norm
    (the models' call: fp32 q, k beside bf16 v, dO), without (input products in bf16), fp32."""
    monkeypatch.setenv("FUSETUNE_GDR_DOT", mode)
    inputs = make_inputs(
        batch=2,
        seq_len=1024,
        key_heads=2,
        value_heads=4,
        key_dim=128,
        value_dim=128,
        unit_keys=not l2norm,
    )
    run_check(inputs, dtype, "chunk", fixed=dict(use_qk_l2norm_in_kernel=l2norm))


# GPU-only cases are few: each dtype x head size x option compiles every chunk kernel anew (the
# IEEE-product kernels take seconds each). K = V = 128 in fp32 and bf16 (fp16 shares bf16's
# code but for the pointer type: the matrix covers it at small sizes), T = 700 and 1000 share
# their stride specialisations, so the two tests below compile two variants of each kernel.
@pytest.mark.skipif(not ON_GPU, reason="GPU pass only: T = 1000 is slow under the interpreter")
@pytest.mark.parametrize(
    "algo,dtype",
    [("chunk", torch.float32), ("chunk", torch.bfloat16), ("recurrent", torch.bfloat16)],
    ids=["chunk-fp32", "chunk-bf16", "recurrent-bf16"],
)
def test_long_sequences_gpu(algo, dtype):
    """Qwen3.5's head sizes (K = V = 128, two value heads a key head), l2norm, T = 1000."""
    inputs = make_inputs(
        batch=2,
        seq_len=1000,
        key_heads=2,
        value_heads=4,
        key_dim=128,
        value_dim=128,
        unit_keys=False,
    )
    run_check(inputs, dtype, algo, fixed=dict(use_qk_l2norm_in_kernel=True))


@pytest.mark.skipif(not ON_GPU, reason="GPU pass only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strong_decays_gpu(dtype):
    """Decay rates up to 16 as Qwen3.5 initialises A (exp(g) down to 1e-7 and chunk cumsums in
    the hundreds): dg must keep the strongly decaying heads (the running-sum form of dg lost
    them)."""
    inputs = make_inputs(
        batch=2,
        seq_len=700,
        key_heads=2,
        value_heads=4,
        key_dim=128,
        value_dim=128,
        unit_keys=False,
        decay_scale=16.0,
    )
    run_check(inputs, dtype, "chunk", fixed=dict(use_qk_l2norm_in_kernel=True))


@pytest.mark.skipif(not ON_GPU, reason="GPU pass only: T = 1000, K = V = 128")
@pytest.mark.parametrize("level", ["auto", "d"])
@pytest.mark.parametrize("decay_scale", [1.0, 16.0], ids=["mild", "strong"])
def test_bf16_products_long_gpu(monkeypatch, level, decay_scale):
    """FUSETUNE_GDR_DOT=bf16 (and bf16 D, W=d) at Qwen3.5's head sizes, compiled: l2norm,
    grouped heads, T = 1000, the models' decays and strong ones (exp(g) down to 1e-7)."""
    monkeypatch.setenv("FUSETUNE_GDR_DOT", "bf16")
    monkeypatch.setenv("FUSETUNE_GDR_W", level)
    inputs = make_inputs(batch=2, seq_len=1000, key_heads=2, value_heads=4, key_dim=128,
                         value_dim=128, unit_keys=False, decay_scale=decay_scale)  # fmt: skip
    run_check(inputs, torch.bfloat16, "chunk", fixed=dict(use_qk_l2norm_in_kernel=True))


@pytest.mark.skipif(not ON_GPU, reason="GPU pass only")
def test_packed_long_sequences_gpu():
    offsets = [0, 700, 1300, 2000]
    inputs = make_inputs(batch=1, seq_len=2000, value_heads=4, key_dim=64, value_dim=100, n_seq=3)
    check_packed(inputs, offsets, torch.float16)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_bad_input(mode):
    call = fusetune.gated_delta_rule
    if mode == "compile":
        call = torch.compile(call, backend="aot_eager", fullgraph=True, dynamic=True)
    x = {n: t.float().to(DEVICE) for n, t in make_inputs(batch=1, seq_len=8).items()}
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    assert_raises(ValueError, "k must be shaped like q", call, q, k[..., :5], v, g, beta)
    assert_raises(ValueError, "v must have q's batch and time", call, q, k, v[:, :4], g, beta)
    assert_raises(
        ValueError,
        "multiple of q/k's",
        call,
        q.repeat(1, 1, 3, 1),
        k.repeat(1, 1, 3, 1),
        v,
        g,
        beta,
    )
    assert_raises(ValueError, "g must be [B, T, HV]", call, q, k, v, g[:, :, :1], beta)
    assert_raises(ValueError, "beta must be [B, T, HV]", call, q, k, v, g, beta[:, :4])
    assert_raises(ValueError, "beta must be [B, T, HV] (one beta", call, q, k, v, g, v)
    assert_raises(ValueError, "q must be [B, T, HK, K]", call, q[0], k, v, g, beta)
    assert_raises(ValueError, "mode|'fast'", call, q, k, v, g, beta, mode="fast")
    assert_raises(TypeError, "share one dtype", call, q, k.half(), v, g, beta)
    assert_raises(TypeError, "q must be a floating-point", call, q.long(), k, v, g, beta)
    assert_raises(
        TypeError,
        "use_qk_l2norm_in_kernel must be a bool",
        call,
        q,
        k,
        v,
        g,
        beta,
        use_qk_l2norm_in_kernel=1,
    )
    assert_raises(
        ValueError,
        "initial_state must be [N, HV, K, V]",
        call,
        q,
        k,
        v,
        g,
        beta,
        initial_state=x["h0"][:, :, :3],
    )
    cu = torch.tensor([0, 3, 8], device=DEVICE)
    assert_raises(
        ValueError,
        "batch size must be 1",
        call,
        *(t.repeat(2, *([1] * (t.dim() - 1))) for t in (q, k, v, g, beta)),
        cu_seqlens=cu,
    )
    assert_raises(
        TypeError, "cu_seqlens must be an integer", call, q, k, v, g, beta, cu_seqlens=cu.float()
    )


def test_bad_cu_seqlens_values():
    """Value checks (CPU tensors: on the GPU they would cost a host sync)."""
    x = {n: t.float() for n, t in make_inputs(batch=1, seq_len=8).items()}
    check_bad_cu_seqlens_values(
        fusetune.gated_delta_rule, [x[n] for n in ("q", "k", "v", "g", "beta")]
    )


@pytest.mark.parametrize(
    "mode,kernel,backward",
    [("recurrent", "fwd_kernel", False), ("chunk", "wy_kernel", False),
     ("chunk", "bwd_chunk_kernel", True)],
)  # fmt: skip
def test_heads_too_large_for_the_gpu_named(mode, kernel, backward, monkeypatch):
    """A kernel that needs more shared memory than the GPU has: a ValueError naming the op, the
    mode and the head sizes, forward and backward."""
    x = make_inputs(batch=1, seq_len=8, initial_state=False)
    q, k, v, g, beta = (x[n].float().to(DEVICE).requires_grad_() for n in ("q", "k", "v", "g",
                                                                         "beta"))  # fmt: skip
    monkeypatch.setattr(gdr_recurrent if mode == "recurrent" else gdr_chunk, kernel,
                        harness.KernelOutOfSharedMemory())  # fmt: skip

    def call():
        o = fusetune.gated_delta_rule(q, k, v, g, beta, mode=mode)[0]
        if backward:
            o.sum().backward()

    assert_raises(ValueError, f"gated_delta_rule(mode='{mode}') at K = {q.shape[-1]}, V = "
                  f"{v.shape[-1]}|this GPU has 232448", call)  # fmt: skip


def test_key_dim_limit():
    x = make_inputs(batch=1, seq_len=2, key_dim=300, value_dim=4, initial_state=False)
    args = [x[n].float().to(DEVICE) for n in ("q", "k", "v", "g", "beta")]
    assert_raises(
        ValueError, "K (q/k last dim) = 300 exceeds 256", fusetune.gated_delta_rule, *args
    )


# ----------------------------------------------------------------------------- integration


def tiny_qwen3_5(seed=0):
    """A 2-layer Qwen3.5 text model (one Gated DeltaNet layer, one attention layer), fp32, with
    two value heads a key head as the real models have."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5")
    config = transformers.Qwen3_5TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.Qwen3_5ForCausalLM(config).float().to(DEVICE)


@pytest.fixture
def call_counter(monkeypatch):
    from fusetune.integrations import gated_delta

    calls = []
    original = gated_delta._call

    def spy(*args, **kwargs):
        calls.append(kwargs["mode"])
        return original(*args, **kwargs)

    monkeypatch.setattr(gated_delta, "_call", spy)
    return calls


@pytest.fixture
def conv_counter(monkeypatch):
    """Calls of fusetune.causal_conv1d from the routed layers' short convolution."""
    from fusetune.integrations import gated_delta

    calls = []
    original = gated_delta._conv

    def spy(*args):
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(gated_delta, "_conv", spy)
    return calls


def train_steps(model, batches, lr=0.1):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for ids in batches:
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return losses, grads


GATE_PARAMETERS = ("dt_bias", "A_log", "in_proj_a.weight")  # model and layer names


def test_route_tiny_qwen3_5_trains_like_transformers(call_counter, conv_counter):
    """Patched and unpatched training from the same weights on the same batches: equal losses
    (fp32, 1e-5) for three steps and equal gradients, the fused path counted; unroute restores
    transformers' own functions.

    The gate parameters (dt_bias, A_log, in_proj_a) are held to the float64 model instead:
    transformers' fp32 chunk loop is 2e-3 off there (its dg loses the strongly decaying heads,
    exp(g) ~ 1e-7), fusetune 1e-6."""
    from fusetune.integrations import gated_delta

    modeling = sys.modules[type(gated_delta_layer(tiny_qwen3_5())).__module__]
    originals = [getattr(modeling, name) for name, _, _ in gated_delta.SEAMS]
    plain, routed, exact = tiny_qwen3_5(), tiny_qwen3_5(), tiny_qwen3_5().double()
    batches = [torch.randint(0, 97, (2, 14), device=DEVICE) for _ in range(3)]
    want_losses, want_grads = train_steps(plain, batches)
    assert gated_delta.route(routed) == 1
    assert gated_delta.route(routed) == 1  # idempotent
    gated_delta.route(exact)
    try:
        losses, grads = train_steps(routed, batches)
        _, exact_grads = train_steps(exact, batches[:1])
    finally:
        assert gated_delta.unroute(routed) == 1
        gated_delta.unroute(exact)
    assert call_counter == ["chunk"] * 4
    assert len(conv_counter) == 4  # its short convolution too, [B, C, T]
    assert all(shape[0] == 2 and shape[2] == 14 for shape in conv_counter), conv_counter
    assert [getattr(modeling, name) for name, _, _ in gated_delta.SEAMS] == originals
    for step, (loss, want) in enumerate(zip(losses, want_losses, strict=True)):
        assert_close(f"loss step {step}", loss, want, 1e-5)
        for name, grad in grads[step].items():
            if not name.endswith(GATE_PARAMETERS):
                assert_close(f"grad {name} step {step}", grad, want_grads[step][name], 1e-5)
    for name, grad in grads[0].items():
        assert_close(f"grad {name} vs float64", grad, exact_grads[0][name], 1e-5)


def gated_delta_layer(model):
    from fusetune.integrations import gated_delta

    (layer,) = gated_delta.gated_delta_layers(model)
    return layer


def test_route_decoding_with_cache(call_counter):
    """Prefill then one cached token: the chunk and the recurrent seams with carried states
    match transformers' (the recurrent one takes the cached state as initial_state)."""
    from fusetune.integrations import gated_delta

    model = tiny_qwen3_5().eval()
    ids = torch.randint(0, 97, (2, 9), device=DEVICE)

    def decode():
        with torch.no_grad():
            first = model(input_ids=ids[:, :-1], use_cache=True)
            second = model(input_ids=ids[:, -1:], past_key_values=first.past_key_values)
        return first.logits, second.logits

    want = decode()
    gated_delta.route(model)
    try:
        got = decode()
    finally:
        gated_delta.unroute(model)
    assert call_counter == ["chunk", "recurrent"]
    for a, b in zip(got, want, strict=True):
        assert_close("logits", a, b, 1e-5)


def test_route_packed_sequences_match_per_sequence_runs(call_counter):
    """A padding-free batch (cu_seq_lens_q, as transformers passes packed sequences) through a
    routed Gated DeltaNet layer gives what transformers' unrouted layer gives on each sequence
    alone, gradients included: the delta rule and the short convolution (wrapped by route)
    both restart at every sequence start. (Unrouted, transformers refuses cu_seqlens without
    FLA.) The gate parameters' gradients are held to the float64 layer, as above."""
    from fusetune.integrations import gated_delta

    models = {"fp32": tiny_qwen3_5(), "fp64": tiny_qwen3_5().double()}
    offsets = [0, 5, 6, 17, 23]
    hidden = torch.randn(1, offsets[-1], 32, device=DEVICE, dtype=torch.float64)
    upstream = torch.randn(1, offsets[-1], 32, device=DEVICE, dtype=torch.float64)

    def run(name, packed):
        layer = gated_delta_layer(models[name])
        x = hidden.to(next(layer.parameters()).dtype)
        if packed:
            cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
            out = layer(x, cu_seq_lens_q=cu)
        else:
            pairs = zip(offsets[:-1], offsets[1:], strict=True)
            out = torch.cat([layer(x[:, a:b]) for a, b in pairs], dim=1)
        layer.zero_grad()
        (out * upstream.to(out.dtype)).sum().backward()
        return out, {n: p.grad.clone() for n, p in layer.named_parameters()}

    want, want_grads = run("fp32", packed=False)
    gated_delta.route(models["fp32"])
    gated_delta.route(models["fp64"])
    try:
        got, got_grads = run("fp32", packed=True)
        _, exact_grads = run("fp64", packed=False)
    finally:
        gated_delta.unroute(models["fp32"])
        gated_delta.unroute(models["fp64"])
    assert call_counter[0] == "chunk"
    assert_close("packed output", got, want, 1e-5)
    for name, grad in got_grads.items():
        oracle = exact_grads if name.endswith(GATE_PARAMETERS) else want_grads
        assert_close(f"grad {name}", grad, oracle[name], 1e-5)


def test_route_leaves_other_models_alone():
    from fusetune.integrations import gated_delta

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert gated_delta.route(model) == 0
    assert gated_delta.unroute(model) == 0


@pytest.mark.parametrize("walk", ["auto", "transposed"])
def test_walks_bf16_k128(monkeypatch, walk):
    """Both walks at K = 128 in bf16, where auto takes the key-block ones (states_k64_kernel,
    dstates_k64_kernel: two 64-row key blocks, untransposed products into the state or its
    gradient): the float64 oracle met with an initial and a final state, several chunks,
    grouped heads, and packed sequences."""
    monkeypatch.setenv("FUSETUNE_GDR_WALK", walk)
    launched = {name: _CountedLaunches(getattr(gdr_chunk, name))
                for name in ("states_kernel", "states_k64_kernel")}  # fmt: skip
    for name, counted in launched.items():
        monkeypatch.setattr(gdr_chunk, name, counted)
    inputs = make_inputs(batch=1, seq_len=40, key_heads=1, value_heads=2, key_dim=128,
                         value_dim=96)  # fmt: skip
    run_check(inputs, torch.bfloat16, "chunk")
    offsets = [0, 17, 18, 40]  # packed: one sequence of a single token
    packed = make_inputs(batch=1, seq_len=offsets[-1], n_seq=len(offsets) - 1, key_heads=1,
                         value_heads=2, key_dim=128, value_dim=96)  # fmt: skip
    check_packed(packed, offsets, torch.bfloat16)
    taken = "states_k64_kernel" if walk == "auto" else "states_kernel"
    assert launched[taken].count > 0
    assert sum(c.count for c in launched.values()) == launched[taken].count


def test_walk_modes(monkeypatch):
    """The key-block walks where every walk product is bf16 and 64 < K <= 128 (auto);
    FUSETUNE_GDR_WALK=transposed keeps the others; other values are refused by name."""
    key_blocks = gdr_chunk.walks_in_key_blocks
    assert key_blocks(128, 2) and key_blocks(100, 2)
    assert not key_blocks(64, 2) and not key_blocks(256, 2) and not key_blocks(128, 1)
    monkeypatch.setenv("FUSETUNE_GDR_WALK", "transposed")
    assert not key_blocks(128, 2)
    monkeypatch.setenv("FUSETUNE_GDR_WALK", "k64")
    with pytest.raises(ValueError, match=r"FUSETUNE_GDR_WALK must be .*got 'k64'"):
        key_blocks(128, 2)
