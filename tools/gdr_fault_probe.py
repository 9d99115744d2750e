"""Which Gated DeltaNet chunk kernel faults: one fwd+bwd per (FUSETUNE_GDR_W level, shape) in
its own process under CUDA_LAUNCH_BLOCKING=1, so the traceback names the launch.

    PYTHONPATH=src:tests:tools python tools/gdr_fault_probe.py LEVEL BATCH SEQ_LEN
"""

from __future__ import annotations

import sys
import traceback

import torch
from gdr_modes_bench import DIM, HEADS, make_run, ours

from fusetune.bench.cases_gated_delta_rule import _inputs

level, batch, seq_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
shape = (batch, seq_len, HEADS, DIM)
leaves = _inputs(*shape, torch.bfloat16, torch.device("cuda"))
grad_out = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
fwd_bwd, fwd_only = make_run(ours(leaves, "tf32", True), leaves, grad_out)
for name, run in (("forward", fwd_only), ("fwd+bwd", fwd_bwd)):
    try:
        run()
        torch.cuda.synchronize()
        print(f"level {level} B{batch} T{seq_len} {name}: ok", flush=True)
    except Exception:  # noqa: BLE001 (the point is the traceback)
        frames = [f for f in traceback.format_exc().splitlines() if "kernel" in f or "Error" in f]
        print(f"level {level} B{batch} T{seq_len} {name}: FAULT", *frames[-6:], sep="\n  ")
        break
