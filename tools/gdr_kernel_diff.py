"""Which Gated DeltaNet chunk kernel goes wrong in a tensor-core mode: one fwd+bwd per mode on
the same inputs, every tensor argument of every chunk-kernel launch copied right after it runs,
then each launch's arguments compared with the IEEE run's (relative max gap). The first launch
whose outputs differ is the culprit: its inputs are the earlier launches' outputs.

    PYTHONPATH=src:tests python tools/gdr_kernel_diff.py small-fp32 split3
"""

from __future__ import annotations

import os
import sys

import torch

from fusetune.ops.linear_attention import gdr_chunk

sys.path.insert(0, os.path.dirname(__file__))
from gdr_fault_case import DEVICE, inputs  # noqa: E402

import fusetune  # noqa: E402

KERNELS = ["inverse_kernel", "wy_kernel", "states_kernel", "output_kernel", "dstates_kernel",
           "bwd_pairs_kernel", "bwd_chunk_kernel"]


class Spy:
    """Launches a kernel as given and keeps copies of its tensor arguments after it ran; with
    ``want`` (the IEEE run's log) it prints their gaps to the same launch there at once, so that
    a launch that faults later leaves the earlier ones' lines."""

    def __init__(self, kernel, name: str, log: list, want: list | None) -> None:
        self.kernel, self.name, self.log, self.want = kernel, name, log, want

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kernel[grid](*args, **kwargs)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            tensors = [
                a.detach().float().clone() if isinstance(a, torch.Tensor) else None for a in args
            ]
            if self.want is not None:
                report(self.name, tensors, self.want[len(self.log)][1])
            self.log.append((self.name, tensors))

        return launch


def report(name: str, got: list, want: list) -> None:
    gaps = [
        f"{i}:{gap(a, b):.1e}"
        for i, (a, b) in enumerate(zip(got, want, strict=True))
        if a is not None and a.numel() > 1
    ]
    print(f"{name:18s} " + " ".join(gaps), flush=True)


def record(shape: str, mode: str, want: list | None = None) -> list:
    os.environ["FUSETUNE_GDR_DOT"] = mode
    log: list = []
    originals = {name: getattr(gdr_chunk, name) for name in KERNELS}
    for name, kernel in originals.items():
        setattr(gdr_chunk, name, Spy(kernel, name, log, want))
    try:
        xs = inputs(shape)
        o, _ = fusetune.gated_delta_rule(*xs, mode="chunk")
        o.float().square().sum().backward()
    finally:
        for name, kernel in originals.items():
            setattr(gdr_chunk, name, kernel)
    return log


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not finite.any():
        return float("nan")
    return ((a - b).abs()[finite].max() / b.abs()[finite].max().clamp_min(1e-30)).item()


def main() -> None:
    shape, modes = sys.argv[1], sys.argv[2:]
    want = record(shape, "ieee")
    for mode in modes:
        print(
            f"== {shape} {mode}: relative max gap to ieee of each tensor argument after "
            "each launch (argument index: gap; the cu / dummy arguments are garbage)"
        )
        record(shape, mode, want)


if __name__ == "__main__":
    main()
