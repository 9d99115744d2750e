"""fusetune.glu_linear (the GLU and the down projection after it, act(gate) * up not kept for
the backward) against its float64 reference and against ``F.linear(fusetune.swiglu(...))``;
what it saves; bad input; and its use in the patched transformers MLP (full fine-tuning), with
the cases that keep the module call (frozen weight, no grad, hooks, ZeRO-3).

CPU (Triton interpreter): small shapes, a part of the matrix compiled (aot_eager). GPU: the
whole matrix compiled with Inductor, a benchmark-sized case and the memory the forward keeps."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import fusetune
from fusetune.reference.glu_linear import glu_linear as reference_glu_linear
from harness import (
    AUTOCAST,
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    LAYOUTS,
    ON_GPU,
    assert_close,
    assert_raises,
    check_op,
    compiled,
    tolerance,
    uses_kernels,
)

# exp overflowing to inf is expected inside sigmoid and tanh; the interpreter's numpy warns.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")

ROWS, INTERMEDIATE, OUT = (2, 3), 40, 24  # h [2, 3, 40] (not a power of two), y [2, 3, 24]


def make_inputs(rows=ROWS, intermediate=INTERMEDIATE, out=OUT, bias=True):
    inputs = {
        "gate": torch.randn(*rows, intermediate, dtype=torch.float64) * 3.0,
        "up": torch.randn(*rows, intermediate, dtype=torch.float64),
        "weight": torch.randn(out, intermediate, dtype=torch.float64) / intermediate**0.5,
    }
    if bias:
        inputs["bias"] = torch.randn(out, dtype=torch.float64)
    return inputs


def run(inputs, dtype, *, autocast=None, mode="eager", layout="contiguous", activation="silu"):
    """check_op with every tensor an input and a gradient. Under autocast the weight and bias
    are float32 (a module's parameters) and the output comes in the autocast dtype."""
    names = list(inputs)
    params = {"weight": torch.float32, "bias": torch.float32} if autocast else None
    return check_op(
        fusetune.glu_linear,
        reference_glu_linear,
        inputs,
        dtype=dtype,
        cast=names,
        grad=names,
        kwargs={"activation": activation},
        mode=mode,
        autocast=autocast,
        layout=layout,
        output_dtypes=[autocast or dtype],
        input_dtypes=params,
    )


# ----------------------------------------------------------------------------- the matrix

# CPU: every dtype x autocast x layout eager; three compiled cells (aot_eager costs ~1 s each
# here). GPU: all of them compiled too (Inductor).
EAGER_CELLS = [
    pytest.param(dtype, amp, "eager", layout, id=f"{did}-{'amp' if amp else 'noamp'}-{layout}")
    for dtype, did in zip(DTYPES, DTYPE_IDS, strict=True)
    for amp in AUTOCAST
    for layout in LAYOUTS
]
CPU_COMPILED = ("fp32-noamp-contiguous", "bf16-amp-noncontiguous", "fp16-noamp-noncontiguous")
COMPILE_CELLS = [
    pytest.param(dtype, amp, "compile", layout, id=f"compile-{c.id}")
    for c in EAGER_CELLS
    for dtype, amp, _, layout in [c.values]
    if ON_GPU or c.id in CPU_COMPILED
]


@pytest.mark.parametrize("dtype,autocast,mode,layout", EAGER_CELLS + COMPILE_CELLS)
def test_matrix(dtype, autocast, mode, layout):
    assert uses_kernels(torch.empty(0, dtype=dtype, device=DEVICE))
    run(make_inputs(), dtype, autocast=autocast, mode=mode, layout=layout)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_geglu(activation):
    run(make_inputs(), torch.bfloat16, activation=activation)


@pytest.mark.parametrize("rows", [(1,), (5,), (0, 4)], ids=["1-row", "2d", "no-rows"])
def test_shapes_without_bias(rows):
    """One row, 2-D inputs, no rows at all (a zero weight gradient); no bias."""
    inputs = make_inputs(rows=rows, bias=False)
    if 0 in rows:  # no gradient to compare in relative terms: zeros of the right shapes
        gate, up, weight = (inputs[k].float().to(DEVICE).requires_grad_()
                            for k in ("gate", "up", "weight"))  # fmt: skip
        y = fusetune.glu_linear(gate, up, weight)
        y.sum().backward()
        assert y.shape == (0, 4, OUT) and gate.grad.shape == gate.shape
        assert torch.equal(weight.grad, torch.zeros_like(weight))
        return
    run(inputs, torch.float32)


def _plain(gate, up, weight, bias=None, activation="silu"):
    """What the patched MLP ran before: the fused GLU, then torch's linear."""
    if activation == "silu":
        return F.linear(fusetune.swiglu(gate, up), weight, bias)
    return F.linear(fusetune.geglu(gate, up, "none" if activation == "gelu" else "tanh"),
                    weight, bias)  # fmt: skip


def _leaves(inputs, dtype, params_dtype=None):
    params = ("weight", "bias")
    return {
        k: v.to(DEVICE, params_dtype if params_dtype and k in params else dtype).requires_grad_()
        for k, v in inputs.items()
    }


@pytest.mark.parametrize(
    "dtype,autocast",
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.bfloat16), (torch.float16, torch.float16)],
    ids=["fp32", "bf16", "bf16-amp", "fp32-amp", "fp16-amp"],
)  # fmt: skip
def test_same_as_the_glu_then_torch_linear(dtype, autocast):
    """Against ``F.linear(swiglu(gate, up), weight, bias)`` in the same precision: under
    autocast (fp32 weight and bias, as a module's) the same output dtype, the same gradient
    dtypes, and the same values (the same kernels and matmuls: equal up to matmul order)."""
    inputs = make_inputs()
    ours = _leaves(inputs, dtype, torch.float32 if autocast else None)
    theirs = {k: v.detach().clone().requires_grad_() for k, v in ours.items()}
    amp = torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None)
    with amp:
        y = fusetune.glu_linear(**ours)
        want = _plain(**theirs)
    assert y.dtype == want.dtype == (autocast or dtype)
    grad = torch.randn_like(want)
    y.backward(grad)
    want.backward(grad)
    tol = tolerance(y.dtype) / 10
    assert_close("y", y, want, tol)
    for name, t in ours.items():
        assert t.grad.dtype == theirs[name].grad.dtype == t.dtype, name
        assert_close(f"grad {name}", t.grad, theirs[name].grad, tol)


def test_mixed_dtypes_outside_autocast():
    """bf16 gate and up, fp32 weight and bias (F.linear would raise): the matmuls in bf16, the
    output bf16, each gradient in its input's dtype."""
    inputs = make_inputs()
    result = check_op(
        fusetune.glu_linear, reference_glu_linear, inputs, dtype=torch.bfloat16,
        cast=list(inputs), grad=list(inputs),
        input_dtypes={"weight": torch.float32, "bias": torch.float32},
    )  # fmt: skip
    assert result.grads["weight"].dtype == torch.float32
    assert result.outputs[0].dtype == torch.bfloat16


def test_frozen_inputs():
    """Only the weight trains (the product recomputed by the forward kernel), or only gate and
    up (a frozen weight: no product at all in the backward)."""
    inputs = make_inputs(bias=False)
    for trained in (("weight",), ("gate", "up")):
        ours = {k: v.to(DEVICE).float().requires_grad_(k in trained) for k, v in inputs.items()}
        theirs = {k: v.detach().clone().requires_grad_(k in trained) for k, v in ours.items()}
        y, want = fusetune.glu_linear(**ours), _plain(**theirs, bias=None)
        grad = torch.randn_like(want)
        y.backward(grad)
        want.backward(grad)
        for name in inputs:
            if name in trained:
                assert_close(name, ours[name].grad, theirs[name].grad, tolerance(torch.float32))
            else:
                assert ours[name].grad is None


# ----------------------------------------------------------------------------- what it keeps


def _saved(fn):
    """fn()'s result and the tensors autograd saved while it ran."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def _product_sized(saved, like):
    """The saved tensors with h's size: last dim the intermediate size, as many elements."""
    return [t for t in saved if t.dim() and t.shape[-1] == like.shape[-1]
            and t.numel() == like.numel()]  # fmt: skip


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["noamp", "amp"])
def test_the_product_is_not_saved(autocast):
    """glu_linear saves gate and up (the very inputs) and the weight; the GLU then torch's
    linear saves gate, up and h = act(gate) * up as well."""
    ours = _leaves(make_inputs(), torch.bfloat16, torch.float32 if autocast else None)
    amp = torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None)
    with amp:
        y, saved = _saved(lambda: fusetune.glu_linear(**ours))
        _, plain_saved = _saved(lambda: _plain(**ours))
    gate, up = ours["gate"], ours["up"]
    kept = _product_sized(saved, gate)
    assert len(kept) == 2 and {t.data_ptr() for t in kept} == {gate.data_ptr(), up.data_ptr()}
    assert len(_product_sized(plain_saved, gate)) == 3
    assert not any(t.numel() > gate.numel() for t in saved if t is not ours["weight"])
    assert y.shape == (*ROWS, OUT)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_bad_input(mode):
    gate, up = torch.randn(4, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE)
    weight, bias = torch.randn(8, 16, device=DEVICE), torch.randn(8, device=DEVICE)
    call = fusetune.glu_linear
    if mode == "compile":
        call = compiled(fusetune.glu_linear, DEVICE, "aot_eager")
    assert_raises(ValueError, "gate and up must have one shape", call, gate, up[:, :8], weight)
    assert_raises(ValueError, "weight's in-features|must equal gate's last dim", call, gate, up,
                  weight[:, :8])  # fmt: skip
    assert_raises(ValueError, "weight must be 2-D", call, gate, up, weight[0])
    assert_raises(ValueError, "bias must be 1-D [out_features]", call, gate, up, weight, bias[:4])
    assert_raises(TypeError, "gate must be a floating-point", call, gate.long(), up, weight)
    assert_raises(TypeError, "weight must be a floating-point", call, gate, up, weight.int())
    assert_raises(TypeError, "bias must be a floating-point", call, gate, up, weight, bias.int())
    assert_raises(ValueError, "activation must be one of", call, gate, up, weight,
                  activation="relu")  # fmt: skip
    assert_raises(TypeError, "and weight (torch.bfloat16) mix dtypes|float16 with bfloat16",
                  call, gate.half(), up.half(), weight.bfloat16())  # fmt: skip
    if mode == "eager":  # (a meta tensor is not a compiled graph's input)
        assert_raises(ValueError, "tensors must be on one device", call, gate, up,
                      weight.to("meta"))  # fmt: skip


# ----------------------------------------------------------------------------- transformers


def _tiny_llama(**overrides):
    pytest.importorskip("transformers")
    from test_transformers import tiny_model

    return tiny_model("llama", **overrides)


@pytest.fixture
def glu_linear_calls(monkeypatch):
    """Counts the patched MLPs' glu_linear calls; warnings of any earlier test forgotten."""
    from fusetune.integrations import _transformers_forwards as forwards

    calls = []
    original = forwards.glu_linear

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(forwards, "glu_linear", counted)
    monkeypatch.setattr(forwards, "_MLP_WARNED", set())
    return calls


def test_full_fine_tuning_matches_transformers_without_keeping_the_product(glu_linear_calls):
    """A tiny Llama, one training step patched and unpatched: the same loss and gradients,
    the MLP through glu_linear, whose forward keeps two [B, T, I] tensors (gate, up) against
    transformers' four (gate, act(gate), up, h). (Several steps, every family:
    test_transformers.py's parity tests, which count glu_linear too.)"""
    model = _tiny_llama(num_hidden_layers=1)
    theirs_model = copy.deepcopy(model)
    ids = torch.randint(3, 128, (2, 8), device=DEVICE)
    intermediate = torch.empty(*ids.shape, model.config.intermediate_size)
    want, theirs = _saved(lambda: theirs_model(input_ids=ids, labels=ids).loss)
    want.backward()
    fusetune.apply(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, ours = _saved(lambda: model(input_ids=ids, labels=ids).loss)
        got.backward()
    assert glu_linear_calls == [1]
    assert len(_product_sized(theirs, intermediate)) == 4
    assert len(_product_sized(ours, intermediate)) == 2
    assert_close("loss", got, want, tolerance(torch.float32))
    for (name, p), q in zip(model.named_parameters(), theirs_model.parameters(), strict=True):
        assert_close(f"grad {name}", p.grad, q.grad, tolerance(torch.float32))
    fusetune.revert(model)


def test_compiled_patched_mlp_does_not_keep_the_product(glu_linear_calls):
    """torch.compile(fullgraph=True) of a patched MLP (aot_eager on the CPU) traces glu_linear
    and its checks: the compiled forward keeps two [B, T, I] tensors too, and its gradients
    are the eager ones. (The whole patched model compiled: test_transformers.py.)"""
    model = fusetune.apply(_tiny_llama(num_hidden_layers=1))
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 8, model.config.hidden_size, device=DEVICE)
    intermediate = torch.empty(2, 8, model.config.intermediate_size)
    compiled_mlp = compiled(mlp, DEVICE)
    y, saved = _saved(lambda: compiled_mlp(x))
    assert glu_linear_calls, "glu_linear not traced"
    assert len(_product_sized(saved, intermediate)) == 2, [tuple(t.shape) for t in saved]
    y.square().sum().backward()
    grads = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    mlp(x).square().sum().backward()
    for p, grad in zip(mlp.parameters(), grads, strict=True):
        assert_close("compiled grad", grad, p.grad, tolerance(torch.float32))
    fusetune.revert(model)


def _mlp_call(model, grad=True):
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, model.config.hidden_size, device=DEVICE)
    with torch.set_grad_enabled(grad):
        return mlp(x)


def test_the_module_path_where_the_weight_does_not_train(glu_linear_calls):
    """A frozen down_proj (LoRA, a frozen layer) or no grad mode (inference): down_proj is
    called as before, silently (torch's linear keeps no product then either)."""
    model = fusetune.apply(_tiny_llama(num_hidden_layers=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _mlp_call(model, grad=False)
        model.model.layers[0].mlp.down_proj.requires_grad_(False)
        _mlp_call(model)
    assert glu_linear_calls == []
    model.model.layers[0].mlp.down_proj.requires_grad_(True)
    _mlp_call(model)
    assert glu_linear_calls == [1]
    fusetune.revert(model)


@pytest.mark.parametrize("case", ["forward-hook", "pre-hook", "backward-hook", "zero3"])
def test_the_module_path_with_hooks_warns_once(case, glu_linear_calls):
    """A trained down_proj whose call matters (hooks; DeepSpeed ZeRO-3, whose partitioned
    weight carries ds_id and is gathered by a pre-hook): called as before, one warning per
    reason, the same output as the unpatched MLP."""
    model = fusetune.apply(_tiny_llama(num_hidden_layers=1))
    down = model.model.layers[0].mlp.down_proj
    seen = []
    if case == "forward-hook":
        down.register_forward_hook(lambda module, args, out: seen.append(1))
    elif case == "pre-hook":
        down.register_forward_pre_hook(lambda module, args: seen.append(1))
    elif case == "backward-hook":
        down.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(1))
    else:
        down.weight.ds_id = 0
    with pytest.warns(UserWarning, match="down_proj runs as its own module") as caught:
        _mlp_call(model).sum().backward()
    message = str(caught[0].message)
    assert ("ZeRO-3" in message) == (case == "zero3") and len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        _mlp_call(model).sum().backward()
    assert glu_linear_calls == []
    assert len(seen) == (0 if case == "zero3" else 2)
    fusetune.revert(model)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.skipif(not ON_GPU, reason="benchmark-sized: GPU pass")
def test_big():
    """Llama-3.2-1B's down projection on 2048 tokens, bf16 under autocast (fp32 weight)."""
    inputs = make_inputs(rows=(2048,), intermediate=8192, out=2048, bias=False)
    run(inputs, torch.bfloat16, autocast=torch.bfloat16)


@pytest.mark.skipif(not ON_GPU, reason="CUDA memory statistics")
def test_memory_kept_for_the_backward():
    """After the forward, glu_linear holds h's bytes less than the GLU then torch's linear
    (bf16, 4096 x 8192 -> 2048: 64 MiB); its backward's peak is no higher."""
    inputs = make_inputs(rows=(4096,), intermediate=8192, out=2048, bias=False)
    leaves = _leaves(inputs, torch.bfloat16)
    h_bytes = leaves["gate"].numel() * 2

    def kept_and_peak(fn):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = fn(**leaves)
        kept = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        y.backward(torch.ones_like(y))
        peak = torch.cuda.max_memory_allocated() - base
        del y
        for t in leaves.values():
            t.grad = None
        return kept, peak

    kept_and_peak(fusetune.glu_linear)  # warm-up (kernels compiled, cuBLAS workspace)
    kept_and_peak(_plain)
    ours, theirs = kept_and_peak(fusetune.glu_linear), kept_and_peak(_plain)
    assert theirs[0] - ours[0] >= 0.99 * h_bytes, (ours, theirs)
    # (h is written over dh in the backward: no more buffers alive than torch's at its peak)
    assert ours[1] <= 1.01 * theirs[1], (ours, theirs)
