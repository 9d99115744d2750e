"""Benchmark harness behind ``python -m fusetune bench``.

Op-specific modules (``fusetune.bench.cases_<op>``) describe *what* to run as :class:`Case`
objects and :func:`register` them at import; this module decides *how* to run them: which
device, how to time, how to measure memory, what the hardware ceilings are, and how results
are printed, saved and plotted.

On a CUDA machine each provider's forward+backward step is timed with
``triton.testing.do_bench`` (median) and its peak extra memory is read from the CUDA caching
allocator. On a machine without a GPU the same code path runs as a smoke test: tiny shapes,
a handful of ``time.perf_counter`` repetitions, no memory figures and no ceilings, so that the
command always works and the cases files stay exercised by CI.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

# Op name -> module that registers its cases. Modules are imported only for the ops asked for,
# so a broken or slow cases file for one op never gets in the way of benchmarking another.
CASE_MODULES: dict[str, str] = {
    "causal_conv1d": "fusetune.bench.cases_causal_conv1d",
    "cross_entropy": "fusetune.bench.cases_cross_entropy",
    "e2e": "fusetune.bench.cases_e2e",
    "gated_delta_rule": "fusetune.bench.cases_gated_delta_rule",
    "gated_slot_attention": "fusetune.bench.cases_gsa",
    "glu_linear": "fusetune.bench.cases_glu_linear",
    "grpo": "fusetune.bench.cases_grpo",
    "linear_cross_entropy": "fusetune.bench.cases_linear_cross_entropy",
    "log_probs": "fusetune.bench.cases_grpo",
    "lora": "fusetune.bench.cases_lora",
    "moe": "fusetune.bench.cases_moe",
    "rms_norm": "fusetune.bench.cases_rms_norm",
    "rope": "fusetune.bench.cases_rope",
    "swiglu": "fusetune.bench.cases_swiglu",
}

GIB = float(1024**3)

# do_bench budgets (milliseconds of warm-up and of timed repetitions).
CUDA_WARMUP_MS, CUDA_REP_MS = 25, 100
CUDA_QUICK_WARMUP_MS, CUDA_QUICK_REP_MS = 5, 25
# The ceilings are every floor's denominator. They are the BEST rate seen over short bursts
# (sustained matmuls heat the chip and clock down: a 0.5 s median read 680 TFLOP/s on an H100
# where bursts reach about 790), so a floor is never overstated and a fraction never flatters.
PROBE_WARMUP_MS, PROBE_REP_MS = 25, 100

# CPU smoke timing: at most this many timed calls, and stop early once the budget is spent,
# so a slow reference path still finishes within a few seconds per case.
CPU_MAX_REPS = 5
CPU_BUDGET_S = 0.5

# Ceiling probes: a 1 GiB device-to-device copy and a bf16 8192^3 matmul on random data.
COPY_PROBE_BYTES = 1024**3
MATMUL_PROBE_N = 8192

# A step that leaves more than this allocated gets a note (it probably keeps its gradients).
RETAINED_NOTE_BYTES = 16 * 1024**2

ERROR_CHARS_IN_TABLE = 70


@dataclass(frozen=True)
class Case:
    """One benchmark shape of one op, run by every available provider.

    Attributes:
        op: op name, a key of ``CASE_MODULES`` (e.g. ``"cross_entropy"``).
        name: short human-readable shape description, unique within the op
            (e.g. ``"8192x128256 bf16 softcap=30"``).
        make: ``make(device, quick)`` builds the inputs once (the harness seeds
            ``torch.manual_seed(0)`` first) and returns ``{provider: closure}`` in the order the
            providers should appear. Providers are e.g. ``"fusetune"``, ``"torch"``,
            ``"torch.compile"``, ``"liger"``, ``"cce"``; a provider whose library is not
            importable is simply left out. The harness passes ``quick=True`` whenever the
            device is the CPU, and the case must then pick tiny shapes (a smoke run must take
            a few seconds per case).
        floor_bytes: ``floor_bytes(quick)`` -> bytes the step must move at least for the shapes
            ``make`` uses with the same ``quick``; or None.
        floor_flops: ``floor_flops(quick)`` -> FLOPs the step must do at least; or None.
        gpu_only: skip this case on a machine without CUDA.

    Each closure runs ONE forward+backward step: it calls the op and ``.backward()``. Closure
    rules the harness relies on:

    * Gradients accumulate across calls, and the harness calls a closure many times. The
      closure must set ``.grad = None`` on every leaf it differentiates at the END of the step,
      after ``.backward()``, and return nothing big (the loss is fine). A step then leaves
      memory as it found it, so "peak extra" is the step's peak above the inputs, the
      gradients it creates included, as in DESIGN.md's anchors, and alike for every provider.
      On CUDA the harness notes a step that leaves memory allocated (``retained_gib``).
    * No host-device syncs (``.item()``, ``.cpu()``, printing tensors) inside the step.
    * Errors are fine (OOM, a peer's bug): the harness records them per provider and goes on.
    * The first call is an untimed warm-up, so autotuning or ``torch.compile`` happen there.
      Inductor takes tens of seconds to compile on a small CPU: on CPU prefer leaving the
      ``"torch.compile"`` provider out or using ``backend="aot_eager"``.
    """

    op: str
    name: str
    make: Callable[[torch.device, bool], dict[str, Callable[[], object]]]
    floor_bytes: Callable[[bool], float] | None = None
    floor_flops: Callable[[bool], float] | None = None
    gpu_only: bool = False


class UnknownOpError(ValueError):
    """Raised when a benchmark is asked for an op that has no cases."""


# op -> case name -> Case, in registration order.
_REGISTRY: dict[str, dict[str, Case]] = {}


def backward_step(
    run: Callable[[], object],
    grads: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor],
    autocast_dtype: torch.dtype | None = None,
) -> Callable[[], None]:
    """A closure by the :class:`Case` rules: ``run()`` (under autocast to ``autocast_dtype`` on
    the leaves' device when given), backward of its output(s) with ``grads`` (one per output),
    then every leaf's ``.grad`` cleared."""
    device_type = leaves[0].device.type

    def step() -> None:
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            outputs = run()
        outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
        torch.autograd.backward(outputs, list(grads[: len(outputs)]))
        for leaf in leaves:
            leaf.grad = None

    return step


def register(case: Case) -> Case:
    """Add ``case`` to the registry (a later case with the same op and name replaces it)."""
    if not isinstance(case, Case):
        raise TypeError(f"register() expects a fusetune.bench.Case, got {type(case).__name__}")
    if not case.op or not case.name:
        raise ValueError(
            f"a Case needs a non-empty op and name, got op={case.op!r} name={case.name!r}"
        )
    _REGISTRY.setdefault(case.op, {})[case.name] = case
    return case


def three_products_floor(
    shape: tuple[int, ...], cpu_shape: tuple[int, ...]
) -> Callable[[bool], float]:
    """A ``Case.floor_flops`` for a projection's forward and backward: three products (output,
    grad input, grad weight) of 2 x prod(shape) FLOPs each, ``shape`` being rows (or batch and
    time), in-features and out-features; ``cpu_shape`` under the quick (CPU) run."""

    def floor(quick: bool) -> float:
        return 3 * 2.0 * math.prod(cpu_shape if quick else shape)

    return floor


def registered_cases(op: str) -> list[Case]:
    """The cases registered so far for ``op`` (none if its module was not imported yet)."""
    return list(_REGISTRY.get(op, {}).values())


def known_ops() -> list[str]:
    """Ops that can be benchmarked: those with a cases module plus any registered directly."""
    return sorted(set(CASE_MODULES) | set(_REGISTRY))


def load_ops(ops: list[str] | None) -> list[str]:
    """Import the cases modules of ``ops`` (all known ops if None) and return the op names.

    An unknown op, or one whose cases module does not exist, raises :class:`UnknownOpError`
    listing the known ops; with ``ops=None`` a cases module that does not exist yet is skipped
    with a note instead (so ``bench`` with no arguments works while an op is being written). Any
    other import error of a cases module propagates: it is a bug to see, not to skip.
    """
    explicit = ops is not None
    wanted = list(dict.fromkeys(ops)) if ops else known_ops()
    unknown = [op for op in wanted if op not in CASE_MODULES and op not in _REGISTRY]
    if unknown:
        raise UnknownOpError(
            f"unknown op(s) {', '.join(map(repr, unknown))}; "
            f"known ops: {', '.join(known_ops()) or '(none)'}"
        )
    loaded = []
    for op in wanted:
        module = CASE_MODULES.get(op)
        if module is not None:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name != module:
                    raise  # the module exists but something it imports is missing: a real bug
                if explicit:
                    raise UnknownOpError(
                        f"op {op!r} has no cases: its module {module!r} does not exist "
                        f"(known ops: {', '.join(known_ops())})"
                    ) from exc
                print(f"note: skipping op {op!r}: cases module {module!r} not found")
                continue
        loaded.append(op)
    return loaded


# --------------------------------------------------------------------------- device helpers


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    """Give freed memory back so one provider's leftovers do not count against the next.

    Only on CUDA: there memory is measured and big shapes must fit one after the other; on the
    CPU the shapes are tiny and a full ``gc.collect()`` (0.15 s with torch loaded) would cost
    more than the smoke run itself.
    """
    if device.type == "cuda":
        gc.collect()  # cycles (e.g. through a failed step's traceback) can hold GPU tensors
        torch.cuda.empty_cache()


def _reset_compile_caches() -> None:
    """Forget torch.compile's graphs between cases.

    Every case compiles afresh anyway (new shapes); resetting keeps Dynamo's per-function
    recompile limit from silently falling back to eager after a few cases. Only done if Dynamo
    was imported, because importing it just to reset it costs a second.
    """
    if "torch._dynamo" in sys.modules:
        try:
            torch._dynamo.reset()
        except Exception as exc:  # noqa: BLE001 - a failed reset must not stop the benchmark
            print(f"note: torch._dynamo.reset() failed: {_describe(exc)}", file=sys.stderr)


def _pick_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# --------------------------------------------------------------------------- measuring


def _do_bench_ms(
    fn: Callable[[], object], warmup_ms: int, rep_ms: int, mode: str = "median"
) -> float:
    """Milliseconds of ``fn`` on the GPU (CUDA events, L2 flushed between calls)."""
    import triton.testing  # imported here so the CPU smoke path does not need Triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode=mode))


def _cuda_time_ms(fn: Callable[[], object], quick: bool) -> float:
    if quick:
        return _do_bench_ms(fn, CUDA_QUICK_WARMUP_MS, CUDA_QUICK_REP_MS)
    return _do_bench_ms(fn, CUDA_WARMUP_MS, CUDA_REP_MS)


def _cpu_time_ms(fn: Callable[[], object]) -> float:
    """Median wall-clock milliseconds of a few calls of ``fn`` (the caller warmed it up)."""
    samples: list[float] = []
    deadline = time.perf_counter() + CPU_BUDGET_S
    while len(samples) < CPU_MAX_REPS and (not samples or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _peak_extra_gib(fn: Callable[[], object], device: torch.device) -> float:
    """GiB the allocator holds at its peak during one call of ``fn``, above what was live before.

    Measured after a warm-up call, so workspaces that a provider caches across calls are in the
    base; the gradients the step creates are not (closures clear them at the end of a step).
    """
    synchronize(device)
    _release(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()  # the result (e.g. the loss) is dropped at once
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / GIB


def _probe_copy_bytes_per_s(device: torch.device) -> float:
    """Device-to-device copy rate, counting the bytes read and the bytes written."""
    src = torch.randn(COPY_PROBE_BYTES // 4, device=device)
    dst = torch.empty_like(src)
    ms = _do_bench_ms(lambda: dst.copy_(src), PROBE_WARMUP_MS, PROBE_REP_MS, mode="min")
    return 2 * src.nbytes / (ms * 1e-3)


def _probe_matmul_flops_per_s(device: torch.device) -> float:
    """bf16 matmul rate on random data (zeros flatter tensor cores: less power, higher clocks)."""
    n = MATMUL_PROBE_N
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = _do_bench_ms(lambda: a @ b, PROBE_WARMUP_MS, PROBE_REP_MS, mode="min")
    return 2 * n**3 / (ms * 1e-3)


def measure_ceilings(device: torch.device) -> dict[str, float | None]:
    """Measure copy bandwidth (bytes/s) and bf16 matmul rate (FLOP/s), best of many, once per run.

    Both are None on a non-CUDA device; a probe that fails is None with a note printed (a
    missing ceiling only costs the floor column).
    """
    probes = {
        "copy_bytes_per_s": _probe_copy_bytes_per_s,
        "bf16_matmul_flops_per_s": _probe_matmul_flops_per_s,
    }
    ceilings: dict[str, float | None] = dict.fromkeys(probes)
    if device.type != "cuda":
        return ceilings
    for key, probe in probes.items():
        try:
            ceilings[key] = probe(device)
        except Exception as exc:  # noqa: BLE001 - costs only the floor column
            print(f"note: ceiling probe {key} failed: {_describe(exc)}")
        _release(device)
    return ceilings


def floor_ms(
    floor_bytes: float | None, floor_flops: float | None, ceilings: Mapping[str, float | None]
) -> float | None:
    """Least time the step could take: the larger of bytes/bandwidth and FLOPs/matmul rate."""
    bandwidth = ceilings.get("copy_bytes_per_s")
    rate = ceilings.get("bf16_matmul_flops_per_s")
    bounds = []
    if floor_bytes is not None and bandwidth:
        bounds.append(floor_bytes / bandwidth)
    if floor_flops is not None and rate:
        bounds.append(floor_flops / rate)
    return max(bounds) * 1e3 if bounds else None


def _describe(exc: BaseException) -> str:
    """One line naming the exception (OOM messages run to several lines)."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__


# --------------------------------------------------------------------------- running cases


def _row(case: Case, provider: str, device: torch.device, quick: bool) -> dict[str, Any]:
    return {
        "op": case.op,
        "case": case.name,
        "provider": provider,
        "device": str(device),
        "quick": quick,
        "time_ms": None,
        "first_call_ms": None,
        "peak_extra_gib": None,
        "retained_gib": None,
        "floor_bytes": None,
        "floor_flops": None,
        "floor_ms": None,
        "floor_fraction": None,
        "note": "",
        "error": None,
    }


def _case_floors(case: Case, quick: bool) -> tuple[float | None, float | None, str]:
    """Evaluate the case's floor functions; a bug in one costs only the floor column."""
    try:
        nbytes = float(case.floor_bytes(quick)) if case.floor_bytes else None
        flops = float(case.floor_flops(quick)) if case.floor_flops else None
    except Exception as exc:  # noqa: BLE001 - a bug here costs only the floor column
        return None, None, f"floor error: {_describe(exc)}"
    return nbytes, flops, ""


def _bench_provider(
    fn: Callable[[], object], row: dict[str, Any], device: torch.device, quick: bool
) -> None:
    """Warm up, measure memory (CUDA) and time one provider; fill ``row`` in place."""
    cuda = device.type == "cuda"
    try:
        if cuda:
            _release(device)
            before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        fn()  # warm-up: compiles, autotunes, and surfaces errors before anything is measured
        synchronize(device)
        row["first_call_ms"] = (time.perf_counter() - start) * 1e3
        if cuda:
            _check_retained(row, torch.cuda.memory_allocated(device) - before)
            row["peak_extra_gib"] = _peak_extra_gib(fn, device)
            row["time_ms"] = _cuda_time_ms(fn, quick)
        else:
            row["time_ms"] = _cpu_time_ms(fn)
    except Exception as exc:  # noqa: BLE001 - one provider failing must not end the run
        row["error"] = _describe(exc)
    # Outside the except block: by now the traceback, whose frames hold the failed step's
    # tensors, is gone, so the memory really comes back.
    _release(device)


def _check_retained(row: dict[str, Any], retained_bytes: int) -> None:
    """Record what the warm-up step left allocated, with a note if it looks like gradients."""
    row["retained_gib"] = retained_bytes / GIB
    if retained_bytes > RETAINED_NOTE_BYTES:
        note = f"step left {retained_bytes / GIB:.2f} GiB allocated (grads not cleared at end?)"
        row["note"] = f"{row['note']}; {note}" if row["note"] else note


def _run_case(
    case: Case,
    device: torch.device,
    quick: bool,
    providers: list[str] | None,
    ceilings: Mapping[str, float | None],
) -> list[dict[str, Any]]:
    """All rows of one case: one per provider, or one explaining why nothing ran."""
    if case.gpu_only and device.type != "cuda":
        row = _row(case, "-", device, quick)
        row["note"] = "skipped: gpu_only"
        return [row]
    nbytes, flops, floor_note = _case_floors(case, quick)
    torch.manual_seed(0)
    try:
        closures = dict(case.make(device, quick))
    except Exception as exc:  # noqa: BLE001 - e.g. the inputs themselves do not fit
        row = _row(case, "(make)", device, quick)
        row["error"] = _describe(exc)
        _release(device)
        return [row]
    rows = []
    names = list(closures)
    if providers is not None:
        # A provider may carry a label ("fla (Triton < 3.7.1 guard lifted: timing only)"): the
        # name a user types is the part before it.
        by_base = {name.split(" (")[0]: name for name in closures}
        wanted = [by_base.get(p, p) for p in providers]
        names = [name for name in wanted if name in closures]
        for missing in [name for name in wanted if name not in closures]:
            row = _row(case, missing, device, quick)
            row["note"] = "not available"
            rows.append(row)
    for name in names:
        row = _row(case, name, device, quick)
        row.update(floor_bytes=nbytes, floor_flops=flops, note=floor_note)
        print(f"[bench] {case.op} | {case.name} | {name} ...", file=sys.stderr, flush=True)
        _bench_provider(closures[name], row, device, quick)
        row["floor_ms"] = floor_ms(nbytes, flops, ceilings)
        if row["floor_ms"] is not None and row["time_ms"]:
            row["floor_fraction"] = row["floor_ms"] / row["time_ms"]
        # Each result as soon as it exists: a run cut off by a time limit keeps what it measured.
        result = row.get("error") or (
            f"{_fmt(row.get('time_ms'), '.3f')} ms, {_fmt(row.get('peak_extra_gib'), '.3f')} GiB"
        )
        print(f"[bench] {case.op} | {case.name} | {name} = {result}", file=sys.stderr, flush=True)
        rows.append(row)
    del closures
    _release(device)
    _reset_compile_caches()
    return rows


# --------------------------------------------------------------------------- environment


# Module name -> distribution names to ask importlib.metadata for (spellings differ by tool).
_VERSIONED: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton",),
    "fusetune": ("fusetune",),
    "liger_kernel": ("liger-kernel", "liger_kernel"),
    "cut_cross_entropy": ("cut-cross-entropy", "cut_cross_entropy"),
    "fla": ("flash-linear-attention", "fla-core", "fla"),
}


def _version(module: str, dists: tuple[str, ...]) -> str | None:
    """Installed version of ``module``, or None where it is not importable."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    # A source checkout on PYTHONPATH has no metadata; ask the module if it is loaded already
    # (never import a peer here just for its version: some pull in half of transformers).
    loaded = sys.modules.get(module)
    if loaded is not None:
        return str(getattr(loaded, "__version__", "unknown"))
    try:
        return "unknown" if importlib.util.find_spec(module) is not None else None
    except (ImportError, ValueError):
        return None


def environment(device: torch.device, quick: bool) -> dict[str, Any]:
    """What the numbers depend on: hardware, library versions, date."""
    env: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "quick": quick,
        "mode": "cuda" if device.type == "cuda" else "cpu smoke",
        "versions": {m: _version(m, d) for m, d in _VERSIONED.items()},
    }
    return env


# --------------------------------------------------------------------------- reporting


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width text table, one line per row."""
    header = ("op", "case", "provider", "time ms", "peak GiB", "% floor", "note / error")
    lines = []
    for r in rows:
        fraction = r.get("floor_fraction")
        note = r.get("error") or r.get("note") or ""
        if r.get("error"):
            note = "ERROR " + note
        if len(note) > ERROR_CHARS_IN_TABLE:
            note = note[: ERROR_CHARS_IN_TABLE - 3] + "..."
        lines.append(
            (
                r["op"],
                r["case"],
                r["provider"],
                _fmt(r.get("time_ms"), ".3f"),
                _fmt(r.get("peak_extra_gib"), ".3f"),
                _fmt(None if fraction is None else 100 * fraction, ".1f"),
                note,
            )
        )
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=True)]
    # Text columns left-aligned, numbers right-aligned; the last column is not padded.
    right = {3, 4, 5}

    def render(cells: tuple[str, ...]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells[:-1], widths[:-1], strict=True))
        ]
        return "  ".join([*parts, cells[-1]]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(header), rule, *(render(line) for line in lines)])


def format_env(env: Mapping[str, Any], ceilings: Mapping[str, float | None]) -> str:
    """Two lines: where this ran, and the measured ceilings."""
    versions = " ".join(f"{k}={v}" for k, v in env["versions"].items() if v is not None)
    where = f"{env['gpu']} (CUDA {env['cuda']})" if env["gpu"] else "CPU smoke run"
    bandwidth, rate = ceilings.get("copy_bytes_per_s"), ceilings.get("bf16_matmul_flops_per_s")
    if env["gpu"] is None:
        ceiling_line = "ceilings: not measured (no GPU), so no floors"
    else:
        tb_per_s = None if bandwidth is None else bandwidth / 1e12
        tflop_per_s = None if rate is None else rate / 1e12
        ceiling_line = (
            f"ceilings: copy {_fmt(tb_per_s, '.2f')} TB/s (read+write), "
            f"bf16 matmul {_fmt(tflop_per_s, '.0f')} TFLOP/s"
        )
    return f"env: {where} | python {env['python']} | {versions} | {env['date']}\n{ceiling_line}"


def write_plot(rows: list[dict[str, Any]], env: Mapping[str, Any], path: Path) -> Path | None:
    """Bar chart of time per provider per case, one subplot per op; None without matplotlib."""
    try:
        # The object-oriented API needs no GUI backend and leaves pyplot's global state alone.
        from matplotlib.figure import Figure
    except ImportError:
        print("note: matplotlib is not importable; no plot written")
        return None
    timed = [r for r in rows if r.get("time_ms") is not None]
    ops = list(dict.fromkeys(r["op"] for r in timed))
    if not ops:
        return None
    most_cases = max(len({r["case"] for r in timed if r["op"] == op}) for op in ops)
    fig = Figure(figsize=(max(6.0, 2.0 + 1.8 * most_cases), 3.6 * len(ops)))
    axes = fig.subplots(len(ops), 1, squeeze=False)[:, 0]
    for ax, op in zip(axes, ops, strict=True):
        _plot_op(ax, [r for r in timed if r["op"] == op], op)
    fig.suptitle(f"fusetune bench, forward+backward — {env['gpu'] or 'CPU smoke run'}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _plot_op(ax: Any, rows: list[dict[str, Any]], op: str) -> None:
    """Grouped bars: one group per case, one bar per provider."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    times = {(r["case"], r["provider"]): r["time_ms"] for r in rows}
    width = 0.8 / len(providers)
    for i, provider in enumerate(providers):
        xs = [
            j + (i - (len(providers) - 1) / 2) * width
            for j, case in enumerate(cases)
            if (case, provider) in times
        ]
        ys = [times[(case, provider)] for case in cases if (case, provider) in times]
        ax.bar(xs, ys, width, label=provider)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=15, ha="right", rotation_mode="anchor", fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.set_title(op)
    values = list(times.values())
    # Shapes span orders of magnitude; a log axis keeps the small cases readable.
    if min(values) > 0 and max(values) / min(values) > 50:
        ax.set_yscale("log")
    ax.legend(fontsize=7)


def write_results(
    out_dir: Path,
    env: Mapping[str, Any],
    ceilings: Mapping[str, float | None],
    rows: list[dict[str, Any]],
) -> Path:
    """Write results.json into ``out_dir`` and return its path."""
    path = out_dir / "results.json"
    payload = {"env": dict(env), "ceilings": dict(ceilings), "rows": rows}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


# --------------------------------------------------------------------------- entry points


def run_bench(
    ops: list[str] | None,
    quick: bool,
    out_dir: str | Path,
    providers: list[str] | None = None,
    *,
    device: str | torch.device | None = None,
    name_filter: str | None = None,
) -> list[dict[str, Any]]:
    """Benchmark the registered cases of ``ops`` (all if None) and return one row per provider.

    ``device`` defaults to CUDA when available, else the CPU; on the CPU the run is always a
    quick smoke run and ``gpu_only`` cases are skipped. ``providers`` restricts (and orders) the
    providers run; a requested one that a case lacks gets a "not available" row. Prints a table,
    and writes ``results.json`` and ``results.png`` into ``out_dir``.
    """
    dev = _pick_device(device)
    quick = quick or dev.type != "cuda"
    op_names = load_ops(ops)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    env = environment(dev, quick)
    ceilings = measure_ceilings(dev)
    rows: list[dict[str, Any]] = []
    for op in op_names:
        for case in registered_cases(op):
            if name_filter and name_filter.lower() not in case.name.lower():
                continue
            rows.extend(_run_case(case, dev, quick, providers, ceilings))

    print(format_table(rows))
    print(format_env(env, ceilings))
    json_path = write_results(out, env, ceilings, rows)
    png_path = write_plot(rows, env, out / "results.png")
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fusetune bench",
        description="Time forward+backward and peak extra memory of fusetune ops against torch "
        "and importable peers (tiny smoke run on a machine without a GPU).",
    )
    parser.add_argument(
        "ops", nargs="*", help=f"ops to benchmark (default: all; known: {', '.join(known_ops())})"
    )
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repetitions")
    parser.add_argument(
        "--out",
        default="bench_results",
        metavar="DIR",
        help="folder for results.json and results.png (default: %(default)s)",
    )
    parser.add_argument(
        "-k",
        "--filter",
        default=None,
        metavar="TEXT",
        help="run only the cases whose name contains TEXT (case-insensitive)",
    )
    parser.add_argument(
        "--providers",
        default=None,
        metavar="A,B,C",
        help="comma-separated providers to run, e.g. fusetune,torch,liger",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry: returns 0, 2 for an unknown op, 1 if a ``fusetune`` provider failed.

    Errors of other providers (torch running out of memory, a peer's bug) are results, not
    failures of the command.
    """
    args = build_parser().parse_args(argv)
    providers = None
    if args.providers:
        providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    try:
        rows = run_bench(args.ops or None, args.quick, args.out, providers, name_filter=args.filter)
    except UnknownOpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = [r for r in rows if r["provider"] == "fusetune" and r["error"]]
    return 1 if failed else 0
