"""The test harness every op's tests use.

``check_op`` runs an op forward and backward on fresh random inputs, in one cell of the matrix
dtype x autocast x {eager, compile} x {contiguous, non-contiguous}, and compares every output and
every gradient with the op's pure-PyTorch reference evaluated in float64 on the CPU, on the very
same (already rounded) input values. Tolerances live in one table, ``TOLERANCES``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pytest
import torch

import fusetune
from fusetune._triton import INTERPRET
from fusetune.finetune.distributed import free_port  # noqa: F401 - the tests' import point

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def _patch_the_language_once_a_launch() -> None:
    """Triton's interpreter (3.9) swaps triton.language's builtins for its own at each launch
    (``GridExecutor``: ``_patch_lang``, undone after the grid) and again at every call of a
    @triton.jit helper inside the kernel (``InterpretedFunction.__call__``), though the swap
    still holds then: ``inspect.getmembers`` over tl, tl.core, tl.math and tl.tensor, finding
    nothing left to swap (a swapped member is no longer a builtin) and setting the same stateless
    stand-ins (range, reduce, tensor.__bool__, ...) again. A helper called per chunk or per
    product pays it each time (the Qwen3.5 fp32 test: 6218 swaps for 74 launches). Here a
    helper's call inside a launch skips the swap when every language module its globals name
    (tl and / or tl.core) was swapped earlier in that launch, by the launch or by a helper (a
    helper's swap is never undone; triton.language.standard's helpers, tl.sum and the like, name
    tl.core where the kernels name tl); anything else takes the interpreter's own. The kernels
    run the same interpreted code on the same values; only the repeated swap is gone. Where the
    interpreter's internals differ from these names, nothing is changed. Done where this module
    is imported: by conftest, and by the ranks a test spawns (mp.spawn imports the test's
    module, which imports this one)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    names = ("_patch_lang", "_LangPatchScope", "GridExecutor")
    done = hasattr(interpreter, "_fusetune_swap_once")
    if done or not all(hasattr(interpreter, name) for name in names):
        return
    interpreter._fusetune_swap_once = True  # (harness imported under a second name: once)
    swap = interpreter._patch_lang
    languages = (tl, tl.core)
    state = {"launch": None}  # None outside a launch, "starting", then the modules it swapped

    named_by: dict[object, frozenset[int]] = {}  # (a module's globals may gain tl later)

    def modules(fn) -> frozenset[int]:
        key = (fn, len(fn.__globals__))
        if key not in named_by:
            found = (m for m in fn.__globals__.values() if any(m is lang for lang in languages))
            named_by[key] = frozenset(map(id, found))
        return named_by[key]

    def patch_lang(fn):
        launch, named = state["launch"], modules(fn)
        if launch == "starting":  # the launch's own swap, undone after its grid
            state["launch"] = named
        elif launch is not None and named and named <= launch:
            return interpreter._LangPatchScope()  # still swapped: nothing to do or undo
        elif launch is not None:  # a helper's own swap (tl.sum's names tl.core): never undone
            state["launch"] = launch | named
        return swap(fn)

    launch_call = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        state["launch"] = "starting"
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            state["launch"] = None

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = call


if INTERPRET:
    _patch_the_language_once_a_launch()

# Relative error ||out - ref|| / ||ref|| allowed for a single pass whose result is stored in (or
# computed in) this dtype. The max-abs guard allows MAX_ABS_FACTOR times that, relative to max|ref|.
TOLERANCES = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}
MAX_ABS_FACTOR = 10.0

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
MODES = ["eager", "compile"]
AUTOCAST = [None, torch.bfloat16]
LAYOUTS = ["contiguous", "noncontiguous"]


def matrix(dtypes: Sequence[torch.dtype] = DTYPES) -> Callable:
    """Parametrize a test over dtype x autocast x mode x layout (the full dtype-contract matrix).

    Eager cells: all of them, on every machine. Compiled cells: all on the GPU (Inductor); on the
    CPU (aot_eager) a pairwise covering set, half of them: every (dtype, autocast), (dtype,
    layout) and (autocast, layout) pair still compiles at least once. There a compiled cell runs
    the very kernels its eager twin interprets; what it adds is the trace (the fake kernels'
    shapes, dtypes and strides, the autograd registration, dynamic sizes), which each of those
    values reaches in the kept cells. Each compiled cell costs 2-15 s of tracing on 2 cores
    (2026-11-28, twenty-third session: 886 worker-s of the CPU suite's 4558)."""

    def compiled_on_cpu(dtype: torch.dtype, autocast: torch.dtype | None, layout: str) -> bool:
        index = dtypes.index(dtype)  # alternate the layouts so that each dtype gets both
        return layout == LAYOUTS[(index + (autocast is not None)) % 2]

    def decorate(test: Callable) -> Callable:
        cells = []
        for dtype in dtypes:
            for autocast, amp in zip(AUTOCAST, ["noamp", "amp"], strict=True):
                for mode in MODES:
                    for layout in LAYOUTS:
                        if (
                            mode == "compile"
                            and not ON_GPU
                            and len(dtypes) > 1
                            and not compiled_on_cpu(dtype, autocast, layout)
                        ):
                            continue
                        cell_id = f"{layout}-{mode}-{amp}-{DTYPE_IDS[DTYPES.index(dtype)]}"
                        cells.append(pytest.param(dtype, autocast, mode, layout, id=cell_id))
        return pytest.mark.parametrize("dtype,autocast,mode,layout", cells)(test)

    return decorate


def tolerance(*dtypes: torch.dtype | None) -> float:
    """The loosest tolerance among the dtypes a result went through."""
    return max(TOLERANCES.get(d, TOLERANCES[torch.float32]) for d in dtypes if d is not None)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    denominator = ref.norm().item()
    return (out - ref).norm().item() / (denominator if denominator > 0 else 1.0)


def assert_close(
    name: str, out: torch.Tensor, ref: torch.Tensor, tol: float, atol: float = 0.0
) -> None:
    """Relative-norm error within ``tol``, max-abs error within the guard, no NaN/inf in out
    that ref does not have. ``atol`` (per element, RMS) admits results whose exact value is 0,
    where any rounding is an infinite relative error. Messages say what failed and by how much."""
    assert out.shape == ref.shape, (
        f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    )
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    bad = ~torch.isfinite(out64) & torch.isfinite(ref64)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} non-finite elements (first at {bad.nonzero()[0].tolist()})"
    )
    finite = torch.isfinite(ref64)
    assert torch.equal(out64[~finite].nan_to_num(), ref64[~finite].nan_to_num()), (
        f"{name}: non-finite mismatch"
    )
    out64, ref64 = out64[finite], ref64[finite]
    error = relative_error(out64, ref64)
    slack = atol * math.sqrt(ref64.numel()) / max(ref64.norm().item(), 1e-300)
    assert error <= tol + slack, f"{name}: relative error {error:.3g} > {tol:.3g}"
    if ref64.numel():
        max_abs = (out64 - ref64).abs().max().item()
        bound = MAX_ABS_FACTOR * (tol * ref64.abs().max().item() + atol)
        assert max_abs <= bound, f"{name}: max abs error {max_abs:.3g} > {bound:.3g}"


def place(tensor: torch.Tensor, device: torch.device, layout: str) -> torch.Tensor:
    """Copy to ``device``; "noncontiguous" gives the copy padded rows (a strided view with a
    unit last stride, as a slice of a larger tensor is) or, for 1-D tensors, a stride of 2."""
    if layout == "contiguous" or tensor.dim() == 0:
        return tensor.to(device).contiguous()
    if tensor.dim() == 1:
        wide = torch.empty(tensor.shape[0] * 2, dtype=tensor.dtype, device=device)
        wide[::2] = tensor.to(device)
        return wide[::2]
    wide = torch.empty(*tensor.shape[:-1], tensor.shape[-1] + 3, dtype=tensor.dtype, device=device)
    wide.fill_(math.nan) if tensor.dtype.is_floating_point else wide.fill_(-1)
    view = wide[..., : tensor.shape[-1]]
    view.copy_(tensor.to(device))
    assert not view.is_contiguous()
    return view


def flatten_outputs(result: object) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def compiled(fn: Callable, device: torch.device, backend: str | None = None) -> Callable:
    """torch.compile(fullgraph, dynamic). On the CPU the default backend is aot_eager: it runs
    fake tensors, dynamic shapes and the autograd registration in a second, not Inductor's 30."""
    torch._dynamo.reset()
    backend = backend or ("inductor" if device.type == "cuda" else "aot_eager")
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)


@dataclass
class Result:
    """What ``check_op`` measured, for tests that assert more."""

    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    ref_outputs: list[torch.Tensor]
    ref_grads: dict[str, torch.Tensor]


def check_op(
    op: Callable,
    reference: Callable,
    inputs: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    cast: Sequence[str],
    grad: Sequence[str] = (),
    kwargs: Mapping[str, object] | None = None,
    device: torch.device = DEVICE,
    mode: str = "eager",
    autocast: torch.dtype | None = None,
    layout: str = "contiguous",
    compute_dtype: torch.dtype | None = None,
    output_dtypes: Sequence[torch.dtype | None] | None = None,
    backend: str | None = None,
    atol: float = 0.0,
    input_dtypes: Mapping[str, torch.dtype] | None = None,
    tolerance_factor: float = 1.0,
) -> Result:
    """Run ``op(**inputs, **kwargs)`` forward and backward and compare with ``reference``.

    inputs: float64 / integer CPU tensors, freshly random. Names in ``cast`` are rounded to
        ``dtype`` first; the reference sees the rounded values in float64, so the comparison
        measures the op's arithmetic, not the input rounding.
    grad: input names to differentiate; each gradient must come back in its input's dtype.
    compute_dtype: the precision the op legitimately computes in (e.g. float32 for a loss from
        bf16 logits). Default: ``dtype``, or the autocast dtype when autocast is on.
    output_dtypes: the dtype each output must have (None: the input dtype ``dtype``).
    mode: "eager" or "compile" (``backend`` overrides the compile backend).
    atol: see ``assert_close``; for cases whose exact result is 0.
    input_dtypes: per-input dtypes that override ``dtype`` for mixed-precision cases (each
        such input is rounded to its own dtype and its gradient must come back in it).
    tolerance_factor: multiplies the table's tolerance, for an op whose math amplifies one
        legitimate rounding (the test states why next to the factor).
    The backward pass uses random upstream gradients, never ones.
    """
    kwargs = dict(kwargs or {})
    own_dtypes = {k: (input_dtypes or {}).get(k, dtype) for k in cast}
    rounded = {k: (v.to(own_dtypes[k]) if k in cast else v) for k, v in inputs.items()}

    # Copies, so that marking a reference input as requiring grad leaves the op's untouched.
    ref_inputs = {k: v.double() if k in cast else v.clone() for k, v in rounded.items()}
    for name in grad:
        ref_inputs[name].requires_grad_(True)
    ref_outputs = flatten_outputs(reference(**ref_inputs, **kwargs))

    test_inputs = {k: place(v, device, layout) for k, v in rounded.items()}
    for name in grad:
        test_inputs[name].requires_grad_(True)
    run = (
        compiled(lambda **kw: op(**kw, **kwargs), device, backend)
        if mode == "compile"
        else (lambda **kw: op(**kw, **kwargs))
    )
    amp = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with amp:
        outputs = flatten_outputs(run(**test_inputs))

    compute_dtype = compute_dtype or autocast or dtype
    expected_dtypes = output_dtypes or [None] * len(outputs)
    assert len(outputs) == len(ref_outputs), (
        f"{len(outputs)} outputs, reference has {len(ref_outputs)}"
    )
    for i, (out, ref, want) in enumerate(zip(outputs, ref_outputs, expected_dtypes, strict=True)):
        want = want or dtype
        assert out.dtype == want, f"output {i}: dtype {out.dtype}, expected {want}"
        assert out.device.type == device.type, f"output {i} on {out.device}, expected {device}"
        tol = tolerance(out.dtype, compute_dtype) * tolerance_factor
        assert_close(f"output {i}", out, ref, tol, atol)

    grads, ref_grads = {}, {}
    if grad:
        differentiable = [
            (o, r) for o, r in zip(outputs, ref_outputs, strict=True) if r.requires_grad
        ]
        upstream = [torch.randn_like(r) for _, r in differentiable]
        torch.autograd.backward([r for _, r in differentiable], upstream)
        torch.autograd.backward(
            [o for o, _ in differentiable],
            [
                u.to(device=device, dtype=o.dtype)
                for (o, _), u in zip(differentiable, upstream, strict=True)
            ],
        )
        for name in grad:
            got, want = test_inputs[name].grad, ref_inputs[name].grad
            assert got is not None, f"no gradient for {name}"
            assert got.dtype == test_inputs[name].dtype, (
                f"grad {name}: dtype {got.dtype}, expected {test_inputs[name].dtype}"
            )
            tol = tolerance(got.dtype, compute_dtype) * tolerance_factor
            assert_close(f"grad {name}", got, want, tol, atol)
            grads[name], ref_grads[name] = got, want
    return Result(outputs, grads, ref_outputs, ref_grads)


def assert_raises(error: type[Exception], match: str, fn: Callable, *args, **kwargs) -> None:
    """``fn`` raises ``error`` whose message contains every ``|``-separated word of ``match``.

    Under torch.compile(fullgraph=True) Dynamo re-raises an error from traced code as its own
    exception type, carrying ours (type and message) in its text: that passes too. Some Dynamo
    versions (torch 2.11) carry an f-string message unformatted, its literal pieces and its
    values apart ("'v'", "' must have ...'"), so there each phrase's words are checked one by
    one."""
    dynamo_error = torch._dynamo.exc.TorchDynamoException
    with pytest.raises((error, dynamo_error)) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    if isinstance(info.value, dynamo_error):
        assert error.__name__ in message, f"{error.__name__} not in: {message}"
    for phrase in match.split("|"):
        if isinstance(info.value, dynamo_error) and phrase not in message:
            missing = [word for word in phrase.split() if word not in message]
            assert not missing, f"{missing} (of {phrase!r}) not in error message: {message}"
        else:
            assert phrase in message, f"{phrase!r} not in error message: {message}"


class KernelOutOfSharedMemory:
    """Stands in for a Triton kernel (``kernel[grid](...)``) whose launch fails as one that
    needs more shared memory than the GPU has: Triton's OutOfResources, 278528 bytes against
    the H100's 232448."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from fusetune._triton import OutOfResources

            raise OutOfResources(278528, 232448, "shared memory")

        return launch


def uses_kernels(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s ops run Triton (compiled or interpreted), not the reference."""
    return fusetune.backend(tensor) != "reference"


def graphs_compiled() -> int:
    """Graphs Dynamo compiled in this process so far (torch._dynamo.reset() keeps the count)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def fused_ops_run(step: Callable[[], object]) -> dict[str, int]:
    """fusetune's custom ops that ``step()`` executes, by name, with how often each ran (the
    profiler records ops inside compiled graphs too, forward and backward)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("fusetune::"):
            name = event.name.removeprefix("fusetune::")
            counts[name] = counts.get(name, 0) + 1
    return counts
