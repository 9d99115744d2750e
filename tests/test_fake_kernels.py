"""Every custom op's fake kernel describes exactly what its real kernel returns.

torch.compile traces the ops through their fakes and Inductor then asserts the real outputs'
strides; a fake that says row-major where the real op returns a transposed buffer (as
causal_conv1d_backward's weight gradient once did) fails only on the GPU, in compiled code.
Here ``torch.library.opcheck`` runs each op for real and through its fake on the same inputs
and compares every output's shape, dtype, strides, storage offset and device (test_faketensor),
and checks that the op mutates only what its schema declares (test_schema).

The cases are the arguments the ops' autograd Functions pass: strided inputs where the
wrappers pass them, optional tensors absent and present, every flag that changes which outputs
exist, 16-bit inputs with fp32 outputs. Every op registered in the ``fusetune`` library must
have a case here: a new op without one fails ``test_every_registered_op_has_cases``.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
import torch.nn.functional as F

import fusetune.ops
from fusetune import _utils
from harness import DEVICE

OPS = torch.ops.fusetune
BF16, F32 = torch.bfloat16, torch.float32
# Loss options of the cross-entropy family: ignore_index, label smoothing, z-loss, scale, softcap
PLAIN = (-100, 0.0, 0.0, None, None)
SHAPED = (-100, 0.1, 1e-4, 0.5, 30.0)


def _import_all_ops() -> None:
    """Import every module under fusetune.ops, so that every op is registered."""
    for module in pkgutil.walk_packages(fusetune.ops.__path__, "fusetune.ops."):
        importlib.import_module(module.name)


def registered_ops() -> set[str]:
    _import_all_ops()
    return {name.split("::", 1)[1] for name in _utils._LIBRARY._op_defs}


def rand(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE).to(dtype)


def labels(n: int, vocab: int) -> torch.Tensor:
    """Class ids with one ignored row."""
    ids = torch.randint(0, vocab, (n,), device=DEVICE)
    ids[1] = -100
    return ids


def cols(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """A column slice (a non-contiguous view, as a fused projection's split gives)."""
    return t[..., start:stop]


# ============================================================================ cases


def glu_forward():
    fused = rand(3, 16, dtype=BF16)
    return [(cols(fused, 0, 8), cols(fused, 8, 16), "silu"),
            (rand(2, 3, 8), rand(2, 3, 8, dtype=BF16), "gelu_tanh")]  # fmt: skip


def glu_backward():
    fused = rand(3, 16, dtype=BF16)
    gate, up = cols(fused, 0, 8), cols(fused, 8, 16)
    return [(rand(3, 8, dtype=BF16), gate, up, "silu", store) for store in (False, True)] + [
        (rand(2, 3, 8), rand(2, 3, 8, dtype=BF16), rand(2, 3, 8), "gelu", True)
    ]


def glu_backward_():
    return [(rand(3, 8), rand(3, 8), rand(3, 8), "silu", store) for store in (False, True)]


def _conv_args():
    x = rand(2, 5, 3).transpose(1, 2)  # [B, C, T] seen through a [B, T, C] buffer
    cases = []
    for xs, bias, silu in ((x, rand(3), True), (x.contiguous(), None, False)):
        cases.append((xs, rand(3, 4), bias, silu))
    return cases


def causal_conv1d_forward():
    return _conv_args()


def causal_conv1d_backward():
    return [(rand(*args[0].shape), *args) for args in _conv_args()]


def cross_entropy_forward():
    logits, ids = rand(4, 10, dtype=BF16), labels(4, 10)
    scale = torch.tensor(0.25, device=DEVICE)
    return [
        (logits, ids, scale, *PLAIN, False, None),
        (logits, ids, scale, *SHAPED, True, rand(10).abs()),
        (rand(2, 4, 10), labels(8, 10).view(2, 4), scale, *PLAIN, True, None),
        (cols(rand(4, 12), 0, 10), ids, scale, *PLAIN, True, None),
    ]


def cross_entropy_forward_inplace():
    scale = torch.tensor(0.25, device=DEVICE)
    return [(rand(4, 10, dtype=BF16), labels(4, 10), scale, *options, weight)
            for options, weight in ((PLAIN, None), (SHAPED, rand(10).abs()))]  # fmt: skip


def cross_entropy_backward():
    cases = []
    for args in cross_entropy_forward()[:3]:
        logits, ids, scale, *options, _, weight = args
        _, lse, _ = OPS.cross_entropy_forward(*args)
        for grad in (rand(ids.numel()), scale):
            cases.append((grad, logits, ids, lse, *options, weight))
    return cases


def scale_rows_():
    return [(rand(4, 10, dtype=BF16), torch.tensor(0.5, device=DEVICE)),
            (rand(2, 3, 10), torch.tensor(1.0, device=DEVICE))]  # fmt: skip


def _head_inputs(dtype=BF16):
    """hidden [N, H], weight [V, H], bias [V], labels [N] (the matmul dtype)."""
    return rand(6, 8, dtype=dtype), rand(10, 8, dtype=dtype), rand(10, dtype=dtype), labels(6, 10)


def linear_cross_entropy_forward():
    hidden, weight, bias, ids = _head_inputs()
    scalar, per_row = torch.tensor(0.5, device=DEVICE), rand(6)
    return [
        (hidden, weight, bias, ids, scalar, *PLAIN, 0, True, True, True, False, False, None),
        (hidden, weight, None, ids, per_row, *SHAPED, 4, True, False, False, True, True,
         rand(10).abs()),
        (hidden, weight, None, ids, scalar, *PLAIN, 2, False, True, False, False, True, None),
        (hidden, weight, bias, ids, scalar, *PLAIN, 0, False, False, False, False, False, None),
    ]  # fmt: skip


def linear_cross_entropy_backward():
    cases = []
    for args in linear_cross_entropy_forward():
        hidden, weight, bias, ids, _, *rest = args
        options, chunk, flags, fp32, weights = rest[:5], rest[5], rest[6:9], rest[9:11], rest[11]
        no_grads = (False,) * 5
        _, lse, *_ = OPS.linear_cross_entropy_forward(*args[:10], chunk, *no_grads, weights)
        if any(flags):
            cases.append((rand(6), hidden, weight, bias, ids, lse, *options, chunk, *flags,
                          *fp32, weights))  # fmt: skip
    return cases


def lm_head_forward():
    hidden, weight, bias, ids = _head_inputs()
    return [
        (hidden, weight, bias, ids, -100, None, None, 0, True, True),
        (hidden, weight, None, ids, -100, 0.5, 30.0, 4, False, True),
        (hidden, weight, None, ids, -100, None, None, 0, True, False),
        (hidden, weight, bias, ids, -100, None, None, 2, False, False),
    ]


def lm_head_backward():
    hidden, weight, bias, ids = _head_inputs()
    cases = []
    for bias_, want_entropy, chunk in ((bias, True, 0), (None, False, 4)):
        head = (-100, None, None, chunk)
        _, lse, entropy, _ = OPS.lm_head_forward(hidden, weight, bias_, ids, *head,
                                                 want_entropy, False)  # fmt: skip
        grad_entropy = rand(6) if want_entropy else None
        for flags, fp32 in (((True, True, True), (False, False)),
                            ((True, False, False), (True, True)),
                            ((False, True, False), (False, True))):  # fmt: skip
            cases.append((rand(6), grad_entropy, hidden, weight, bias_, ids, lse, entropy,
                          *head, *flags, *fp32))  # fmt: skip
    cases.append((None, rand(6), hidden, weight, bias, ids, lse, entropy, -100, None, None, 0,
                  True, True, True, False, False))  # fmt: skip
    return cases


def grpo_forward():
    hidden, weight, bias, ids = _head_inputs()
    per_token = [rand(6) for _ in range(4)]
    advantages, weights, old, ref = per_token
    grpo = (0.0, 0.2, 0.2, None, "grpo", 1.0, 1.05, False)
    kl = (0.04, 0.2, 0.28, 2.0, "dapo", 1.0, 1.05, True)
    sapo = (0.0, 0.2, 0.2, None, "sapo", 1.0, 1.05, False)
    return [
        (hidden, weight, bias, ids, advantages, weights, None, None, *grpo, None, None, 0,
         True, True, True),
        (hidden, weight, None, ids, advantages, weights, old, ref, *kl, 0.5, 30.0, 4,
         True, False, False),
        (hidden, weight, None, ids, advantages, weights, old, None, *sapo, None, None, 2,
         False, True, False),
        (hidden, weight, bias, ids, advantages, weights, None, None, *grpo, None, None, 0,
         False, False, False),
    ]  # fmt: skip


def _moe_args(dtype, *, lora, bias, transposed):
    """moe_forward's arguments: 5 tokens, 2 of 3 experts each, H 8, I 4, rank 2."""
    n, experts, hidden, inter, rank = 5, 3, 8, 4, 2
    ids = torch.stack([torch.randperm(experts, device=DEVICE)[:2] for _ in range(n)])
    gate_up, down = rand(experts, 2 * inter, hidden, dtype=dtype), rand(experts, hidden, inter,
                                                                        dtype=dtype)  # fmt: skip
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    biases = (rand(experts, 2 * inter), rand(experts, hidden)) if bias else (None, None)
    adapters = (None,) * 4
    if lora:
        adapters = (rand(experts, rank, hidden), rand(experts, 2 * inter, rank),
                    rand(experts, rank, inter), rand(experts, hidden, rank))  # fmt: skip
    return (rand(n, hidden, dtype=dtype), ids, rand(n, 2).softmax(-1), gate_up, down, *biases,
            *adapters, 0.5, 2.0, transposed, transposed, int(transposed), 1.702, 7.0)  # fmt: skip


MOE_VARIANTS = [dict(lora=False, bias=False, transposed=False),
                dict(lora=True, bias=False, transposed=False),
                dict(lora=False, bias=True, transposed=True)]  # fmt: skip


def moe_forward():
    return [_moe_args(dtype, **variant) for dtype in (BF16, F32) for variant in MOE_VARIANTS]


def moe_backward():
    cases = []
    for dtype in (BF16, F32):
        for variant in MOE_VARIANTS:
            args = _moe_args(dtype, **variant)
            _, tokens, slots, offsets, gu, xa_gu, xa_d = OPS.moe_forward(*args)
            tensors, options = args[:11], args[11:]
            present = [tensors[i] is not None for i in (0, 2, 3, 4, 5, 6, 7, 8, 9, 10)]
            wanted = [True, True, not variant["lora"], not variant["lora"], *present[4:]]
            # every gradient that can exist, then every other one of them
            for needs in (wanted, [want and i % 2 == 0 for i, want in enumerate(wanted)]):
                needs = [bool(n) and p for n, p in zip(needs, present, strict=True)]
                grad = rand(*args[0].shape, dtype=dtype)
                saved = (tokens, slots, offsets, gu, xa_gu, xa_d)
                cases.append((grad, *tensors, *options[:2], *saved, *options[2:], needs))
    return cases


def rope_rotate():
    cases = []
    for layout in ("BTHD", "BHTD"):
        # transformers' q: view(B, T, H, D).transpose(1, 2) for BHTD
        q = rand(2, 3, 4, 8).transpose(1, 2) if layout == "BHTD" else rand(2, 3, 4, 8)
        k = rand(2, 3, 2, 8, dtype=BF16)
        k = k.transpose(1, 2) if layout == "BHTD" else k
        cos, sin = rand(1, 3, 6), rand(1, 3, 6)
        for transpose in (False, True):
            cases.append((q, k, cos, sin, None, layout, False, transpose))
        table = rand(7, 8)
        cases.append((q, k, table, table.clone(), torch.tensor([4, 0, 6], device=DEVICE), layout,
                      True, False))  # fmt: skip
    return cases


def dequantize_4bit():
    out_features, in_features, blocksize = 6, 32, 64
    n = out_features * in_features
    packed = torch.randint(0, 256, (n // 2, 1), dtype=torch.uint8, device=DEVICE)
    code = torch.linspace(-1, 1, 16, device=DEVICE)
    shape = [out_features, in_features]
    plain = (packed, rand(n // blocksize + 1).abs(), code, None, None, None, blocksize, 1)
    nested = (packed, torch.randint(0, 256, (n // blocksize + 1,), dtype=torch.uint8,
                                    device=DEVICE),
              code, rand(1).abs(), torch.linspace(-1, 1, 256, device=DEVICE), rand(1), blocksize,
              256)  # fmt: skip
    return [(*plain, shape, BF16, 0), (*nested, shape, F32, 1)]


def rms_norm_forward():
    x = cols(rand(3, 2, 12, dtype=BF16), 0, 8)
    weight = rand(8)
    return [
        (x, None, weight, 1e-6, 0.0, "llama", None),
        (x, rand(3, 2, 8), weight.to(BF16), 1e-6, 1.0, "gemma", None),
        (x, None, weight, 1e-6, 0.0, "none", rand(3, 2, 8, dtype=BF16)),
    ]


def rms_norm_backward():
    cases = []
    for x, residual, weight, eps, offset, casting, gate in rms_norm_forward():
        _, new_residual, rstd = OPS.rms_norm_forward(x, residual, weight, eps, offset, casting,
                                                     gate)  # fmt: skip
        normed = x if residual is None else new_residual
        grad_residual = None if residual is None else rand(*normed.shape, dtype=normed.dtype)
        for weight_grad in (True, False):
            cases.append((rand(*normed.shape, dtype=normed.dtype), grad_residual, normed, weight,
                          rstd, offset, casting, weight_grad, gate))  # fmt: skip
    return cases


def _lora_glu(dtype):
    """lora_glu_forward's arguments as _LoraMLPFunction passes them (xa_gate and xa_up are
    column slices of one [N, r_gate + r_up] product)."""
    n, inter, rank = 5, 12, 3
    xa = rand(n, 2 * rank, dtype=dtype)
    return (rand(n, inter, dtype=dtype), rand(n, inter, dtype=dtype), cols(xa, 0, rank),
            cols(xa, rank, 2 * rank), rand(inter, rank, dtype=dtype),
            rand(inter, rank, dtype=dtype), 0.5, 2.0, "swiglu")  # fmt: skip


def lora_glu_forward():
    return [_lora_glu(BF16), _lora_glu(F32)[:-1] + ("geglu_tanh",)]


def lora_glu_backward():
    cases = []
    for args in lora_glu_forward():
        n, inter = args[0].shape
        dtype = args[0].dtype
        cases.append((rand(n, inter, dtype=dtype), rand(n, 4, dtype=dtype),
                      rand(4, inter, dtype=dtype), 0.25, *args))  # fmt: skip
    return cases


def lora_add_mm_():
    """acc [N, out] += alpha a [N, r] @ b [r, out], b a transposed view as the ops pass it."""
    return [(rand(6, 10, dtype=BF16), rand(6, 4, dtype=BF16), rand(10, 4, dtype=BF16).t(), 1.0),
            (rand(6, 10), rand(6, 4), rand(4, 10), 2.0)]  # fmt: skip


def _gdr_args():
    """(q, k, v, g, beta, h0, cu_seqlens, scale): batch 2 or packed; HK 1, HV 2, K 8, V 4."""

    def inputs(batch, time, dtype):
        q, k = rand(batch, time, 1, 8, dtype=dtype), rand(batch, time, 1, 8, dtype=dtype)
        g = F.logsigmoid(rand(batch, time, 2)) / 4
        return q, k, rand(batch, time, 2, 4, dtype=dtype), g, rand(batch, time, 2).sigmoid()

    batched = inputs(2, 5, BF16)
    packed = inputs(1, 7, F32)
    cu = torch.tensor([0, 3, 7], device=DEVICE, dtype=torch.int32)
    # l2-normalised fp32 q and k with bf16 v, as the public function passes them to the
    # recurrent kernels (the chunk kernels normalise raw q and k themselves: the l2norm flag)
    mixed = (F.normalize(rand(2, 5, 1, 8), dim=-1), F.normalize(rand(2, 5, 1, 8), dim=-1),
             *batched[2:])  # fmt: skip
    return [(*batched, None, None, 0.35), (*packed, rand(2, 2, 8, 4), cu, 0.35),
            (*mixed, rand(2, 2, 8, 4), None, 0.35)]  # fmt: skip


# (output_final_state, chunked) for each argument set of _gdr_args / _gsa_args: every flag
# value and both modes with and without initial states, without the full product (the chunked
# kernels are the slowest cases under the interpreter). The gated delta rule's sets add its l2norm
# flag (chunk mode's kernels normalise raw q, k; the mixed set is the recurrent mode's input).
FLAGS_PER_ARGS = (((False, True), (True, False)), ((True, True), (False, False)), ((True, True),))
GDR_FLAGS_PER_ARGS = (
    ((False, True, False), (True, False, False), (False, True, True)),
    ((True, True, False), (False, False, False)),
    ((True, False, False),),
)


def with_flags(arg_sets, flags_per_args=FLAGS_PER_ARGS):
    return [
        (*args, *flags)
        for args, flag_sets in zip(arg_sets, flags_per_args, strict=True)
        for flags in flag_sets
    ]


def gated_delta_rule_forward():
    return with_flags(_gdr_args(), GDR_FLAGS_PER_ARGS)


def gated_delta_rule_backward():
    cases = []
    for *args, final, chunked, l2norm in gated_delta_rule_forward():
        o, h_t, t_kept = OPS.gated_delta_rule_forward(*args, final, chunked, l2norm)
        dh_t = rand(*h_t.shape) if final else None
        do = rand(*o.shape, dtype=o.dtype)
        cases.append((do, dh_t, *args[:5], t_kept, *args[5:], final, chunked, l2norm))
    return cases


def _gsa_args():
    """(q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout): HQ 2, H 1, K 8, V 4, M 3."""

    def inputs(batch, time, layout, dtype):
        def shape(heads, dim):
            return (batch, time, heads, dim) if layout == "BTHD" else (batch, heads, time, dim)

        g = F.logsigmoid(rand(*shape(1, 3))) / 4
        return (rand(*shape(2, 8), dtype=dtype), rand(*shape(1, 8), dtype=dtype),
                rand(*shape(1, 4), dtype=dtype), (1 - g.exp()).to(dtype), g)  # fmt: skip

    cu = torch.tensor([0, 2, 6], device=DEVICE)
    return [
        (*inputs(2, 5, "BTHD", BF16), None, None, None, 0.35, "BTHD"),
        (*inputs(2, 5, "BHTD", F32), rand(2, 1, 8, 3), rand(2, 1, 3, 4), None, 0.35, "BHTD"),
        (*inputs(1, 6, "BTHD", F32), rand(2, 1, 8, 3), rand(2, 1, 3, 4), cu, 0.35, "BTHD"),
    ]


def gsa_forward():
    return with_flags(_gsa_args())


def gsa_backward():
    cases = []
    for *args, final, chunked in gsa_forward():
        o, hk_t, hv_t = OPS.gsa_forward(*args, final, chunked)
        states = (rand(*hk_t.shape), rand(*hv_t.shape)) if final else (None, None)
        cases.append((rand(*o.shape, dtype=o.dtype), *states, *args, final, chunked))
    return cases


CASES = {
    case.__name__: case
    for case in (
        glu_forward,
        glu_backward,
        glu_backward_,
        causal_conv1d_forward,
        causal_conv1d_backward,
        cross_entropy_forward,
        cross_entropy_forward_inplace,
        cross_entropy_backward,
        scale_rows_,
        linear_cross_entropy_forward,
        linear_cross_entropy_backward,
        lm_head_forward,
        lm_head_backward,
        grpo_forward,
        moe_forward,
        moe_backward,
        rope_rotate,
        dequantize_4bit,
        rms_norm_forward,
        rms_norm_backward,
        lora_glu_forward,
        lora_glu_backward,
        lora_add_mm_,
        gated_delta_rule_forward,
        gated_delta_rule_backward,
        gsa_forward,
        gsa_backward,
    )
}


# ============================================================================ tests


def test_every_registered_op_has_cases():
    registered = registered_ops()
    assert len(registered) >= 26, sorted(registered)
    missing = registered - set(CASES)
    assert not missing, f"ops without a fake-kernel case in {__file__}: {sorted(missing)}"
    stale = set(CASES) - registered
    assert not stale, f"cases for ops that are not registered: {sorted(stale)}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_fake_kernel_matches_real_outputs(name):
    _import_all_ops()
    op = getattr(OPS, name).default
    cases = CASES[name]()
    assert cases, f"{name}: no argument case"
    for index, args in enumerate(cases):
        try:
            torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        except Exception as error:
            raise AssertionError(f"{name} case {index}: {error}") from error
