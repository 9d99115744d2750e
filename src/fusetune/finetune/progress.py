"""A plain progress bar on stderr (no dependency): step, loss, tokens/s, peak memory, time.

On a terminal the line is redrawn in place; otherwise (a log file, CI) about ten lines are
printed over the run, so logs stay short.
"""

from __future__ import annotations

import sys
from typing import TextIO

import torch

GIB = float(1024**3)
BAR_WIDTH = 20
LINES_WHEN_NOT_A_TTY = 10


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes, kind): the CUDA allocator's peak on a GPU; the process's peak resident set on
    the CPU (process-wide, so it only ever grows); (None, "") where neither is known."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda"
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return None, ""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return kib * scale, "rss"


def format_memory(nbytes: int | None, kind: str) -> str:
    if nbytes is None:
        return "n/a"
    text = f"{nbytes / GIB:.2f} GiB"
    return f"{text} (process RSS)" if kind == "rss" else text


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressBar:
    """``update`` once per optimizer step; ``close`` at the end (or on an error)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None):
        self.total, self.label = total, label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = max(1, total // LINES_WHEN_NOT_A_TTY)
        self.open = False

    def update(
        self, step: int, loss: float, tokens_per_s: float, memory: str, elapsed: float
    ) -> None:
        filled = BAR_WIDTH * step // self.total
        bar = "=" * filled + (">" if filled < BAR_WIDTH else "") + " " * (BAR_WIDTH - filled - 1)
        eta = elapsed / step * (self.total - step)
        digits = len(str(self.total))
        line = (
            f"{self.label} {step:>{digits}}/{self.total} [{bar[:BAR_WIDTH]}] loss {loss:.4f} | "
            f"{tokens_per_s:,.0f} tok/s | peak {memory} | "
            f"{format_duration(elapsed)}<{format_duration(eta)}"
        )
        if self.tty:
            self.stream.write("\r\033[K" + line)
            self.open = True
            if step == self.total:
                self.close()
        elif step == 1 or step % self.every == 0 or step == self.total:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False
