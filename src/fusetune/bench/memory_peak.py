"""What is live at a step's memory peak, by where it was allocated (``bench e2e --nproc N
--memory-peak``): the CUDA caching allocator's history of one step is replayed to the moment the
allocated bytes peak, and the blocks live then are summed by the innermost frame of their
Python stack that belongs to fusetune, transformers, PEFT or torch's distributed / optimizer /
autograd code (torch's own tensor frames say nothing about why). Blocks allocated before the
step (parameters, gradients kept, optimizer state) are one line of their own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

# Frames that name why a block exists.
TELLING = ("fusetune/", "transformers/", "peft/", "torch/distributed/", "torch/optim/",
           "torch/autograd/", "torch/utils/checkpoint")  # fmt: skip
MAX_ENTRIES = 1_000_000
NOT_CUDA = "memory peak: not measured (CUDA's caching allocator only)"


def _site(frames: list[dict]) -> str:
    """The innermost frame of a telling library (the bench's own frames skipped), else the
    innermost Python frame: ``library/path:line function``."""
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    for frame in python:
        name = frame["filename"]
        marker = next((m for m in TELLING if m in name), None)
        if marker and "fusetune/bench/" not in name:  # from the library's folder on
            return f"{name[name.rfind(marker) :]}:{frame['line']} {frame['name']}"
    for frame in python:
        if "fusetune/bench/" not in frame["filename"]:
            return f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"
    return "(no Python frame)"


def _replay(trace: list[dict], stop: int | None) -> tuple[int, int, dict, int]:
    """(index of the peak, bytes above the start at the peak, live blocks, freed blocks from
    before the step) after replaying ``trace`` up to ``stop`` (the whole trace if None)."""
    live: dict[int, tuple[int, list]] = {}
    current = peak = peak_index = freed_before = 0
    for index, event in enumerate(trace if stop is None else trace[: stop + 1]):
        action, address, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[address] = (size, event.get("frames", []))
            current += size
        elif action == "free_completed":
            current -= size
            if live.pop(address, None) is None:
                freed_before += size  # allocated before the recording started
        if current > peak:
            peak, peak_index = current, index
    return peak_index, peak, live, freed_before


def live_at_peak(step: Callable[[], None], device: torch.device, top: int = 14) -> list[str]:
    """One call of ``step`` under the allocator's history: lines naming the step's peak (GiB
    above the start and in all), what was allocated before the step, and the ``top`` sites of
    what the step held at its peak (GiB, blocks). Off CUDA one line says so (no step runs)."""
    if device.type != "cuda":
        return [NOT_CUDA]
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][device.index or 0]
    index, _, _, _ = _replay(trace, None)
    _, above, live, freed_before = _replay(trace, index)
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        site = sites[_site(frames)]
        site[0] += size
        site[1] += 1
    gib = 2**30
    lines = [f"peak of one step: {(before + above) / gib:.2f} GiB allocated, "
             f"{above / gib:.2f} above its start; before the step {before / gib:.2f} GiB "
             f"({freed_before / gib:.2f} of it freed by the peak)"]  # fmt: skip
    ranked = sorted(sites.items(), key=lambda item: -item[1][0])
    for site, (size, count) in ranked[:top]:
        lines.append(f"  {size / gib:7.3f} GiB  {count:5d} blocks  {site}")
    rest = sum(size for _, (size, _) in ranked[top:])
    if rest:
        lines.append(f"  {rest / gib:7.3f} GiB  {len(ranked) - top:5d} other sites")
    return lines
