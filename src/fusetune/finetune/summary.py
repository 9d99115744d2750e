"""What the fine-tuning command prints at the end: a summary of the run and, with --compare,
the run without fusetune beside the run with it."""

from __future__ import annotations

import math
from collections.abc import Sequence

from fusetune.finetune.progress import format_duration, format_memory
from fusetune.finetune.train import WARMUP_STEPS, RunResult

MAX_LOSS_ROWS = 12
GIB = float(1024**3)


def final_loss(losses: Sequence[float]) -> float:
    """Mean of the last tenth of the steps (at least one): less noisy than the last step.
    Steps skipped for a non-finite loss are left out (NaN if every step was)."""
    finite = [v for v in losses if math.isfinite(v)]
    tail = max(1, len(finite) // 10)
    return sum(finite[-tail:]) / tail if finite else float("nan")


def throughput_note(result: RunResult) -> str:
    """Which steps tokens/s counts: all, or all but the warm-up step and (under --compile) the
    steps that compiled a graph, or (under --cuda-graph) the eager steps and the capture
    (``result.untimed`` of them)."""
    ran = len(result.losses) - result.resumed_from
    left_out = result.untimed
    if left_out == 0:
        return "all steps"
    if left_out == WARMUP_STEPS and ran >= 3:
        return f"first {WARMUP_STEPS} step left out"
    if left_out >= ran:
        return "every step compiled: none timed"
    return f"{left_out} of {ran} steps left out: warm-up and compiling or capturing"


def format_summary(result: RunResult, lines: dict[str, str]) -> str:
    """``lines``: the run's description (model, data, precision, saved, ...), in order."""
    losses = result.losses
    rows = dict(lines)
    rows["loss"] = f"{losses[0]:.4f} (step 1) -> {final_loss(losses):.4f} (last steps)"
    rows["throughput"] = f"{result.tokens_per_s:,.0f} tokens/s ({throughput_note(result)})"
    rows["peak memory"] = format_memory(result.peak_memory, result.memory_kind)
    ran = len(losses) - result.resumed_from
    resumed = f" (resumed after step {result.resumed_from})" if result.resumed_from else ""
    rows["time"] = f"{format_duration(result.seconds)} for {ran} steps{resumed}"
    width = max(len(key) for key in rows)
    body = [f"  {key:<{width}}  {value}" for key, value in rows.items()]
    return "\n".join(["fusetune finetune: done", *body])


def loss_rows(count: int, limit: int = MAX_LOSS_ROWS) -> list[int]:
    """Step indices to print: all of them up to ``limit``, else evenly spread, first and last
    included."""
    if count <= limit:
        return list(range(count))
    return sorted({round(i * (count - 1) / (limit - 1)) for i in range(limit)})


def format_comparison(baseline: RunResult, fused: RunResult) -> str:
    """Per-step losses, tokens/s, peak memory and time of the two runs side by side."""
    names = (baseline.label, fused.label)
    width = max(12, *(len(n) for n in names))
    header = f"{'':<12}  {names[0]:>{width}}  {names[1]:>{width}}  {'difference':>12}"
    lines = [f"same {len(fused.losses)} steps, same data and initial weights:", header]
    for index in loss_rows(len(fused.losses)):
        a, b = baseline.losses[index], fused.losses[index]
        label = f"loss step {index + 1}"
        lines.append(f"{label:<12}  {a:>{width}.4f}  {b:>{width}.4f}  {b - a:>+12.2e}")
    speedup = fused.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else 0.0
    lines.append(
        f"{'tokens/s':<12}  {baseline.tokens_per_s:>{width},.0f}  "
        f"{fused.tokens_per_s:>{width},.0f}  {speedup:>11.2f}x"
    )
    lines.append(_memory_row(baseline, fused, width))
    times = (format_duration(baseline.seconds), format_duration(fused.seconds))
    lines.append(f"{'time':<12}  {times[0]:>{width}}  {times[1]:>{width}}")
    if fused.memory_kind == "rss":
        lines.append(
            "(CPU: peak memory is the process's resident set, which only grows, so the second "
            "run's figure includes the first's; compare memory on a GPU)"
        )
    return "\n".join(lines)


def _memory_row(baseline: RunResult, fused: RunResult, width: int) -> str:
    values = [r.peak_memory for r in (baseline, fused)]
    if values[0] is None or values[1] is None:
        return f"{'peak memory':<12}  {'n/a':>{width}}  {'n/a':>{width}}"
    ratio = values[1] / values[0] if values[0] else 0.0
    cells = [f"{v / GIB:.2f} GiB" for v in values]
    return f"{'peak memory':<12}  {cells[0]:>{width}}  {cells[1]:>{width}}  {ratio:>11.2f}x"
