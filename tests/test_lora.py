"""fusetune.lora_linear / lora_qkv / lora_mlp against their float64 references: the
mixed-precision matrix (base dtype x adapter dtype x autocast x eager / compile), x in another
dtype than the base, frozen inputs, checkpointing, gradient accumulation and bad input.

PEFT comparisons and the PEFT integration are in test_lora_peft.py."""

from __future__ import annotations

import functools
import sys
import warnings

import pytest
import torch
import torch.utils.checkpoint

import fusetune
import harness
from fusetune.ops import lora as lora_module
from fusetune.reference import lora as reference
from harness import DEVICE, assert_close, assert_raises, check_op, compiled, uses_kernels

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (base weight dtype, adapter dtype): adapters are float32 or the base dtype.
MIXED = [(BF16, FP32), (BF16, BF16), (FP16, FP32), (FP16, FP16), (FP32, FP32)]
MIXED_IDS = ["bf16-fp32", "bf16", "fp16-fp32", "fp16", "fp32"]
# The MLP chains three matmuls and the activation, each output rounded to the compute dtype.
MLP_TOLERANCE_FACTOR = 1.5


def projection(out_features: int, in_features: int, rank: int, scaling: float, bias=False):
    """Base weight, adapter (B non-zero, as after training; PEFT starts it at 0) as float64."""
    tensors = {
        "weight": torch.randn(out_features, in_features, dtype=torch.float64) / in_features**0.5,
        "lora_a": torch.randn(rank, in_features, dtype=torch.float64) / in_features**0.5,
        "lora_b": torch.randn(out_features, rank, dtype=torch.float64) / rank**0.5,
    }
    if bias:
        tensors["bias"] = torch.randn(out_features, dtype=torch.float64)
    return tensors, scaling


# ----------------------------------------------------------------------------- op wrappers
# check_op passes tensors by name; these turn them into the ops' projection tuples.

QKV_SHAPES = {"q": (32, 4, 0.5), "k": (16, 8, 2.0), "v": (16, 4, 1.0)}  # out, rank, scaling
MLP_SHAPES = {"gate": (150, 4, 2.0), "up": (150, 8, 0.5), "down": (24, 5, 1.5)}


def _tuples(names, scalings, tensors):
    return [
        tuple(tensors[f"{n}_{k}"] for k in ("weight", "lora_a", "lora_b")) + (scalings[n],)
        for n in names
    ]


def qkv_op(fn, scalings, x, **tensors):
    return fn(x, *_tuples("qkv", scalings, tensors))


def mlp_op(fn, scalings, activation, x, **tensors):
    return fn(x, *_tuples(("gate", "up", "down"), scalings, tensors), activation)


def make_case(op: str, lead=(2, 5), *, activation: str = "swiglu", bias: bool = False):
    """(op, reference, float64 inputs, adapter names, base names) for one of the three ops."""
    if op == "linear":
        tensors, scaling = projection(40, 24, 4, 0.75, bias=bias)
        inputs = {"x": torch.randn(*lead, 24, dtype=torch.float64), **tensors}
        op_fn = functools.partial(fusetune.lora_linear, scaling=scaling)
        ref_fn = functools.partial(reference.lora_linear, scaling=scaling)
        return op_fn, ref_fn, inputs, ["lora_a", "lora_b"], ["weight", "bias"][: 1 + bias]
    shapes = QKV_SHAPES if op == "qkv" else MLP_SHAPES
    inputs = {"x": torch.randn(*lead, 24 if op == "mlp" else 32, dtype=torch.float64)}
    scalings, in_features = {}, inputs["x"].shape[-1]
    for name, (out_features, rank, scaling) in shapes.items():
        size_in = 150 if name == "down" else in_features
        tensors, scalings[name] = projection(out_features, size_in, rank, scaling)
        inputs.update({f"{name}_{k}": v for k, v in tensors.items()})
    if op == "qkv":
        op_fn = functools.partial(qkv_op, fusetune.lora_qkv, scalings)
        ref_fn = functools.partial(qkv_op, reference.lora_qkv, scalings)
    else:
        op_fn = functools.partial(mlp_op, fusetune.lora_mlp, scalings, activation)
        ref_fn = functools.partial(mlp_op, reference.lora_mlp, scalings, activation)
    adapters = [f"{n}_{k}" for n in shapes for k in ("lora_a", "lora_b")]
    return op_fn, ref_fn, inputs, adapters, [f"{n}_weight" for n in shapes]


def run(op, base, adapter, *, x_dtype=None, monkeypatch=None, **kw):
    """check_op with x and the adapters differentiated, each tensor in its own dtype."""
    activation = kw.pop("activation", "swiglu")
    lead = kw.pop("lead", (2, 5) if op == "linear" else (70,) if op == "mlp" else (3, 3))
    op_fn, ref_fn, inputs, adapters, bases = make_case(op, lead, activation=activation)
    if op == "mlp" and monkeypatch is not None:
        for dtype in (BF16, FP16):
            tol = harness.TOLERANCES[dtype] * MLP_TOLERANCE_FACTOR
            monkeypatch.setitem(harness.TOLERANCES, dtype, tol)
    dtypes = {name: adapter for name in adapters}
    dtypes.update({name: base for name in bases})
    dtypes["x"] = x_dtype or base
    autocast = kw.get("autocast")
    compute = autocast or reference.compute_dtype(
        torch.empty(0, dtype=dtypes["x"]), torch.empty(0, dtype=base)
    )
    n_outputs = 3 if op == "qkv" else 1
    return check_op(
        op_fn,
        ref_fn,
        inputs,
        dtype=base,
        cast=["x", *adapters, *bases],
        grad=["x", *adapters],
        input_dtypes=dtypes,
        compute_dtype=compute,
        output_dtypes=[compute] * n_outputs,
        **kw,
    )


# ----------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("autocast", [None, BF16], ids=["noamp", "amp"])
@pytest.mark.parametrize("base,adapter", MIXED, ids=MIXED_IDS)
@pytest.mark.parametrize("op", ["linear", "qkv", "mlp"])
def test_mixed_precision_matrix(op, base, adapter, autocast, monkeypatch):
    """Outputs and dx, dA, dB against float64, for every base x adapter dtype, with and without
    autocast. Gradients come back in each input's own dtype."""
    assert uses_kernels(torch.empty(0, dtype=base, device=DEVICE))
    run(op, base, adapter, autocast=autocast, monkeypatch=monkeypatch)


# Compiling costs seconds per case (aot_eager on the CPU, Inductor on the GPU): the compiled
# column covers each adapter-dtype situation once per op.
COMPILED = [(BF16, FP32, BF16), (BF16, BF16, None), (FP16, FP32, None), (FP32, FP32, None)]


@pytest.mark.parametrize(
    "base,adapter,autocast", COMPILED, ids=["bf16-fp32-amp", "bf16", "fp16-fp32", "fp32"]
)
@pytest.mark.parametrize("op", ["linear", "qkv", "mlp"])
def test_mixed_precision_compiled(op, base, adapter, autocast, monkeypatch):
    """The same under torch.compile(fullgraph=True, dynamic=True): fakes, registered ops and
    the autograd Functions traced."""
    run(op, base, adapter, autocast=autocast, mode="compile", monkeypatch=monkeypatch)


@pytest.mark.parametrize("op", ["qkv", "mlp"])
def test_inductor_adds_the_adapter_products_in_place(op):
    """Under Inductor the LoRA products are added into the base matmul's output (and into dx's
    partial sums) in place: the mutable fusetune::lora_add_mm_ with no addmm into a new buffer,
    which copied its input first. Gradients as eager within bf16's rounding (on the CPU they are
    bit-equal; on an H100 dx was not: Inductor lowers the graph's other ops its own way)."""
    from torch._inductor.utils import run_and_get_code

    op_fn, _, inputs, adapters, _ = make_case(op)
    tensors = {name: t.to(DEVICE, BF16).requires_grad_(name in adapters or name == "x")
               for name, t in inputs.items()}  # fmt: skip

    def step(fn):
        out = fn(**tensors)
        sum(y.float().sum() for y in (out if isinstance(out, tuple) else (out,))).backward()
        grads = [tensors[name].grad for name in ["x", *adapters]]
        for name in ["x", *adapters]:
            tensors[name].grad = None
        return grads

    want = step(op_fn)
    torch._dynamo.reset()
    got, code = run_and_get_code(step, torch.compile(op_fn, backend="inductor", fullgraph=True))
    code = "\n".join(code)
    assert code.count("fusetune.lora_add_mm_.default(") == (6 if op == "qkv" else 3), code
    assert "extern_kernels.addmm" not in code, code
    for name, g, w in zip(["x", *adapters], got, want, strict=True):
        assert_close(name, g, w, harness.tolerance(BF16))


@pytest.mark.parametrize("kernel", ["_lora_glu_forward_kernel", "_lora_glu_backward_kernel"])
def test_mlp_ranks_too_large_for_the_gpu_run_unfused(kernel, monkeypatch):
    """A GLU kernel needing more shared memory than the GPU has (rank 256 on an H100): one
    warning naming the ranks, and the adapter products as separate matmuls, with the fused
    path's results (fp32: no rounding between the two)."""
    op_fn, _, inputs, adapters, _ = make_case("mlp")
    tensors = {name: t.float().to(DEVICE).requires_grad_(name in adapters or name == "x")
               for name, t in inputs.items()}  # fmt: skip

    def step():
        out = op_fn(**tensors)
        (out * torch.linspace(-1, 1, out.shape[-1], device=DEVICE)).sum().backward()
        grads = [tensors[name].grad for name in ["x", *adapters]]
        for name in ["x", *adapters]:
            tensors[name].grad = None
        return [out.detach(), *grads]

    want = step()
    monkeypatch.setattr(lora_module, kernel, harness.KernelOutOfSharedMemory())
    ranks = "(4, 8)" if kernel == "_lora_glu_forward_kernel" else "(5, 4, 8)"
    message = f"lora_mlp: LoRA ranks {ranks} need 278528 bytes of shared memory"
    with pytest.warns(UserWarning, match=message.replace("(", r"\(").replace(")", r"\)")):
        got = step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second step does not warn again
        again = step()
    for name, g, a, w in zip(["out", "x", *adapters], got, again, want, strict=True):
        assert_close(name, g, w, harness.tolerance(FP32))
        assert torch.equal(g, a), name


@pytest.mark.parametrize("base", [BF16, FP32], ids=["bf16", "fp32"])
def test_mlp_rank_256(base, monkeypatch):
    """LoRA rank 256 on every MLP projection against the float64 reference: fused where the
    GLU kernels fit the GPU (the CPU's interpreter), through the separate matmuls where they do
    not (an H100: at most one warning a kernel)."""
    shapes = {"gate": (150, 256, 2.0), "up": (150, 256, 0.5), "down": (24, 256, 1.5)}
    monkeypatch.setattr(sys.modules[__name__], "MLP_SHAPES", shapes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run("mlp", base, FP32, lead=(40,), monkeypatch=monkeypatch)
    messages = {str(w.message) for w in caught if "LoRA ranks" in str(w.message)}
    assert len(messages) <= 2, messages
    if DEVICE.type == "cuda":  # the backward needs 344064 bytes at rank 256 (Triton 3.6, sm_90)
        shared = torch.cuda.get_device_properties(DEVICE).shared_memory_per_block_optin
        assert bool(messages) == (shared < 344064), (shared, messages)


@pytest.mark.parametrize("op", ["linear", "qkv", "mlp"])
def test_noncontiguous_input(op, monkeypatch):
    run(op, BF16, FP32, layout="noncontiguous", monkeypatch=monkeypatch)


@pytest.mark.parametrize(
    "x_dtype,base,autocast",
    [(FP32, BF16, None), (BF16, FP32, None), (FP32, FP16, BF16), (FP16, BF16, BF16)],
    ids=["x32-base16", "x16-base32", "x32-base16-amp", "xfp16-basebf16-amp"],
)
@pytest.mark.parametrize("op", ["linear", "mlp"])
def test_x_in_another_dtype(op, x_dtype, base, autocast, monkeypatch):
    """x in any float dtype: float32 meeting a 16-bit base computes in the 16-bit one; under
    autocast the autocast dtype wins; dx comes back in x's dtype."""
    run(op, base, FP32, x_dtype=x_dtype, autocast=autocast, monkeypatch=monkeypatch)


@pytest.mark.parametrize("activation", ["geglu", "geglu_tanh"])
def test_mlp_activations(activation, monkeypatch):
    run("mlp", BF16, FP32, activation=activation, monkeypatch=monkeypatch)


def test_mlp_rows_loop_and_splits(monkeypatch):
    """Fewer backward programs than row blocks: each walks several BM-row steps, and the row
    splits' column sums are added."""
    monkeypatch.setattr(lora_module, "BACKWARD_PROGRAMS_PER_SM", 1)
    result = run("mlp", FP32, FP32, lead=(2, 67), monkeypatch=monkeypatch)
    assert result.outputs[0].shape == (2, 67, 24)


@pytest.mark.parametrize("lead", [(1,), (0,), (1, 1)])
def test_tiny_and_empty_inputs(lead, monkeypatch):
    for op in ("linear", "mlp"):
        op_fn, ref_fn, inputs, adapters, _ = make_case(op, lead)
        x = inputs["x"].float().to(DEVICE).requires_grad_()
        tensors = {k: v.float().to(DEVICE) for k, v in inputs.items() if k != "x"}
        for name in adapters:
            tensors[name].requires_grad_()
        y = op_fn(x, **tensors)
        assert y.shape[:-1] == lead
        y.sum().backward()
        want = ref_fn(inputs["x"], **{k: v for k, v in inputs.items() if k != "x"})
        assert_close("y", y, want, 1e-5, atol=1e-6)
        assert x.grad.shape == x.shape


def test_bias(monkeypatch):
    op_fn, ref_fn, inputs, adapters, bases = make_case("linear", bias=True)
    check_op(op_fn, ref_fn, inputs, dtype=BF16, cast=list(inputs), grad=["x", *adapters])


def test_lora_linear_matches_linear_plus_adapter():
    """The computation it replaces: F.linear plus PEFT's lora_B(lora_A(x)) * scaling."""
    x = torch.randn(6, 16, device=DEVICE)
    weight, lora_a, lora_b = (torch.randn(s, device=DEVICE) for s in ((12, 16), (4, 16), (12, 4)))
    got = fusetune.lora_linear(x, weight, lora_a, lora_b, 0.5)
    want = x @ weight.t() + 0.5 * (x @ lora_a.t()) @ lora_b.t()
    assert_close("y", got, want, 1e-5)


# ----------------------------------------------------------------------------- frozen inputs


@pytest.mark.parametrize("op", ["linear", "qkv", "mlp"])
@pytest.mark.parametrize("trainable", ["adapters", "x", "b-only"])
def test_only_some_inputs_require_grad(op, trainable, monkeypatch):
    """Inputs that need no gradient get none (and cost none); the others stay exact."""
    _, _, inputs, adapters, _ = make_case(op)
    if trainable == "adapters":
        grad = adapters
    elif trainable == "x":
        grad = ["x"]
    else:
        grad = [name for name in adapters if name.endswith("lora_b")]
    op_fn, ref_fn, inputs, adapters, bases = make_case(op, (9,))
    result = check_op(op_fn, ref_fn, inputs, dtype=FP32, cast=["x", *adapters, *bases], grad=grad)
    assert set(result.grads) == set(grad)


def test_frozen_x_skips_the_dx_matmuls(monkeypatch):
    """With x frozen (the first layer of a LoRA model) the backward runs no dx matmul: only the
    thin ones, whose results are [N, r] or adapter-sized."""
    shapes = []
    original_mm = torch.mm

    def spy(a, b, *args, **kwargs):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return original_mm(a, b, *args, **kwargs)

    x = torch.randn(8, 24, device=DEVICE)
    weight = torch.randn(40, 24, device=DEVICE)
    lora_a = torch.randn(4, 24, device=DEVICE, requires_grad=True)
    lora_b = torch.randn(40, 4, device=DEVICE, requires_grad=True)
    y = fusetune.lora_linear(x, weight, lora_a, lora_b, 1.0)
    monkeypatch.setattr(torch, "mm", spy)
    y.backward(torch.randn_like(y))
    monkeypatch.undo()
    if uses_kernels(x):
        assert (tuple(y.shape), tuple(weight.shape)) not in shapes, shapes
        assert all(4 in a or 4 in b for a, b in shapes), shapes
    assert lora_a.grad is not None and lora_b.grad is not None


# ----------------------------------------------------------------------------- training loops


def _leaves(op: str, dtype=FP32):
    op_fn, _, inputs, adapters, _ = make_case(op, (2, 9))
    tensors = {k: v.to(device=DEVICE, dtype=dtype) for k, v in inputs.items()}
    for name in ["x", *adapters]:
        tensors[name].requires_grad_()
    return op_fn, tensors, ["x", *adapters]


def _grads(tensors, names):
    grads = {name: tensors[name].grad.clone() for name in names}
    for name in names:
        tensors[name].grad = None
    return grads


def _loss(outputs):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return sum(
        (o.float() * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum() for o in outputs
    )


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("op", ["linear", "qkv", "mlp"])
def test_activation_checkpointing(op, reentrant):
    """torch.utils.checkpoint (both kinds) recomputes the forward in backward; the gradients
    are the same as without it."""
    op_fn, tensors, names = _leaves(op)
    x, rest = tensors["x"], {k: v for k, v in tensors.items() if k != "x"}
    _loss(op_fn(x, **rest)).backward()
    plain = _grads(tensors, names)

    def block(x, *values):
        return op_fn(x, **dict(zip(rest, values, strict=True)))

    outputs = torch.utils.checkpoint.checkpoint(block, x, *rest.values(), use_reentrant=reentrant)
    _loss(outputs).backward()
    for name, grad in _grads(tensors, names).items():
        assert_close(f"grad {name}", grad, plain[name], 1e-6)


@pytest.mark.parametrize("op", ["linear", "qkv", "mlp"])
def test_gradient_accumulation(op):
    """Two micro-batches, backward after each: the adapters' .grad is the sum."""
    op_fn, tensors, names = _leaves(op)
    x, rest = tensors["x"], {k: v for k, v in tensors.items() if k != "x"}
    adapters = [n for n in names if n != "x"]
    expected = {n: torch.zeros_like(tensors[n]) for n in adapters}
    for part in (x[:1], x[1:]):
        _loss(op_fn(part.detach(), **rest)).backward()
        for n in adapters:
            expected[n] += tensors[n].grad
            tensors[n].grad = None
    for part in (x[:1], x[1:]):
        _loss(op_fn(part.detach(), **rest)).backward()
    for n in adapters:
        assert_close(f"grad {n}", tensors[n].grad, expected[n], 1e-6)


def test_mlp_second_backward_through_one_graph_is_an_error():
    """The first backward overwrote the saved activations with their gradients (in place)."""
    op_fn, tensors, _ = _leaves("mlp")
    if not uses_kernels(tensors["x"]):
        pytest.skip("the reference path keeps its activations")
    loss = _loss(op_fn(tensors["x"], **{k: v for k, v in tensors.items() if k != "x"}))
    loss.backward(retain_graph=True)
    assert_raises(RuntimeError, "backward ran twice|retain_graph", loss.backward)


# ----------------------------------------------------------------------------- bad input


def _bad_linear(**changes):
    x = torch.randn(3, 8, device=DEVICE)
    args = dict(
        weight=torch.randn(6, 8, device=DEVICE),
        lora_a=torch.randn(2, 8, device=DEVICE),
        lora_b=torch.randn(6, 2, device=DEVICE),
        scaling=1.0,
    )
    args.update(changes)
    return x, args


LINEAR_ERRORS = {
    "a-in-features": (dict(lora_a=torch.randn(2, 7)), ValueError, "lora_a|[r, in]"),
    "b-out-features": (dict(lora_b=torch.randn(5, 2)), ValueError, "lora_b|[out, r]"),
    "rank-mismatch": (dict(lora_b=torch.randn(6, 3)), ValueError, "lora_b|rank|lora_a"),
    "adapter-dtypes-differ": (
        dict(lora_b=torch.randn(6, 2, dtype=torch.float64)),
        TypeError,
        "lora_a|lora_b|one dtype",
    ),
    "adapter-dtype-outside-contract": (
        dict(
            weight=torch.randn(6, 8, dtype=BF16),
            lora_a=torch.randn(2, 8, dtype=FP16),
            lora_b=torch.randn(6, 2, dtype=FP16),
        ),
        TypeError,
        "float32 or the base weight",
    ),
    "fp16-x-bf16-base": (
        dict(
            weight=torch.randn(6, 8, dtype=FP16),
            lora_a=torch.randn(2, 8, dtype=FP16),
            lora_b=torch.randn(6, 2, dtype=FP16),
            x_dtype=BF16,
        ),
        TypeError,
        "float16|bfloat16|autocast",
    ),
    "weight-requires-grad": (
        dict(weight=torch.randn(6, 8, requires_grad=True)),
        ValueError,
        "weight|requires grad|frozen",
    ),
    "x-last-dim": (dict(x_features=7), ValueError, "x must be"),
    "bias-shape": (dict(bias=torch.randn(5)), ValueError, "bias|shape"),
    "weight-1d": (dict(weight=torch.randn(6)), ValueError, "weight|[out, in]"),
    "scaling-not-a-number": (dict(scaling="2"), TypeError, "scaling"),
    "integer-adapter": (dict(lora_a=torch.ones(2, 8, dtype=torch.long)), TypeError, "lora_a"),
}


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("case", list(LINEAR_ERRORS))
def test_lora_linear_bad_input(case, mode):
    changes, error, match = LINEAR_ERRORS[case]
    changes = dict(changes)
    x_dtype, x_features = changes.pop("x_dtype", FP32), changes.pop("x_features", 8)
    x = torch.randn(3, x_features, device=DEVICE, dtype=x_dtype)
    _, args = _bad_linear(**changes)
    args = {
        k: (v.to(DEVICE).requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
        for k, v in args.items()
    }
    if mode == "compile" and case in ("weight-requires-grad", "scaling-not-a-number"):
        pytest.skip("checked eagerly; tracing specialises the flag / cannot pass a str scaling")
    fn = fusetune.lora_linear if mode == "eager" else compiled(fusetune.lora_linear, DEVICE)
    assert_raises(error, match, fn, x, **args)


def _bad_projections(**changes):
    x = torch.randn(3, 8, device=DEVICE)

    def proj(out, inn, rank):
        return (
            torch.randn(out, inn, device=DEVICE),
            torch.randn(rank, inn, device=DEVICE),
            torch.randn(out, rank, device=DEVICE),
            1.0,
        )

    specs = {"gate": proj(12, 8, 2), "up": proj(12, 8, 2), "down": proj(8, 12, 2)}
    specs.update(changes)
    return x, specs


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_lora_mlp_bad_input(mode):
    fn = fusetune.lora_mlp if mode == "eager" else compiled(fusetune.lora_mlp, DEVICE)
    x, specs = _bad_projections()
    bad_down = list(specs["down"])
    bad_down[0] = torch.randn(8, 11, device=DEVICE)
    assert_raises(ValueError, "down.weight|12", fn, x, specs["gate"], specs["up"], bad_down)
    bad_up = list(specs["up"])
    bad_up[2] = torch.randn(12, 3, device=DEVICE)
    assert_raises(ValueError, "up.lora_b|rank", fn, x, specs["gate"], bad_up, specs["down"])
    assert_raises(ValueError, "activation|swiglu", fn, x, *specs.values(), "relu")
    if mode == "eager":  # a malformed tuple fails before any tracing matters
        assert_raises(TypeError, "gate|tuple", fn, x, specs["gate"][:3], specs["up"], specs["down"])


def test_lora_qkv_bad_input():
    x, specs = _bad_projections()
    q = specs["gate"]
    bad_k = list(q)
    bad_k[1] = torch.randn(2, 9, device=DEVICE)
    assert_raises(ValueError, "k.lora_a|[r, in]", fusetune.lora_qkv, x, q, bad_k, q)
    bad_v = list(q)
    bad_v[0] = bad_v[0].to(BF16)
    assert_raises(TypeError, "base weights|one dtype", fusetune.lora_qkv, x, q, q, bad_v)
