"""Precision of the GSA kernels against the float64 oracle (fusetune.reference.gsa), two studies.

``issue`` (issue 20, item 4): fp16 inputs as a new user makes them (B2 T1024 H4 with (K=V, M) =
(60, 64), (128, 128), (256, 64); packed sequences of 1000-2000 tokens at H4, D64 and D100;
gates = logsigmoid of standard-normal logits, s = 1 - exp(g)). Prints the max abs error of o,
dq, dk, dv, ds, dg for chunk and recurrent modes, once per precision of fp16 chunk mode's
products of computed operands (FUSETUNE_GSA_DOT, read at import: one subprocess per mode, run
side by side so the kernels compile in parallel; a mode whose process fails, a compile error or
a fault, prints its error and the others go on), then the issue's table.
``times``: fp16 and bf16 forward + backward at the benchmark shape (B4 T4096 H16 D=M=64) per
mode, one process after another (the mode acts on fp16 only; bf16 is the control).

    PYTHONPATH=src:tests python tools/gsa_precision.py issue [tf32x3 tf32 ieee]
    PYTHONPATH=src:tests python tools/gsa_precision.py times [tf32x3 tf32 ieee]

``drops`` (the earlier study): fp32 error of chunk mode, gradients included, for one 16-token
block whose gates drop by a given amount (the factorised diagonal up to gsa_chunk.FAST_DROP, the
exact decay-column loops past it). One row per drop and seed.

    PYTHONPATH=src:tests python tools/gsa_precision.py drops [drop ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import fusetune
from fusetune.reference.gsa import gated_slot_attention as naive
from harness import relative_error
from test_gsa import ISSUE_PACKED, ISSUE_SHAPES, issue_inputs, make_inputs, with_states

MODES = ("tf32x3", "tf32", "ieee")
GRADS = ("q", "k", "v", "s", "g")
ROW = "ROW "  # prefix of the machine-read lines a worker prints (one JSON object each)

# ----------------------------------------------------------------------------- issue 20


def issue_cases() -> list[tuple[str, dict, list[int] | None]]:
    """(name, float64 CPU inputs, packed offsets or None), seeded as tests/test_gsa.py seeds."""
    cases = []
    for dim, slots in ISSUE_SHAPES:
        torch.manual_seed(0)
        cases.append((f"B2 T1024 H4 D{dim} M{slots}", issue_inputs(2, 1024, 4, dim, slots), None))
    for dim, lengths in ISSUE_PACKED:
        torch.manual_seed(0)
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        inputs = issue_inputs(1, offsets[-1], 4, dim, 64, n_seq=len(lengths))
        cases.append((f"packed {lengths} H4 D{dim}", inputs, offsets))
    return cases


def max_abs_errors(fn, inputs: dict, do: torch.Tensor, reference: dict) -> dict[str, float]:
    """Max abs error of o and the gradients of ``fn`` on fp16 copies of ``inputs``."""
    leaves = {n: t.to("cuda", torch.float16).requires_grad_(True) for n, t in inputs.items()}
    o = fn(**leaves)
    o.backward(do.to(o.dtype))
    got = {"o": o.detach()} | {f"d{n}": leaves[n].grad for n in GRADS}
    return {n: (got[n].double() - reference[n]).abs().max().item() for n in got}


def issue_worker() -> None:
    """One precision mode (this process's FUSETUNE_GSA_DOT): a row per case and algorithm."""
    mode = os.environ.get("FUSETUNE_GSA_DOT", "tf32x3")
    for name, inputs, offsets in issue_cases():
        rounded = {n: t.to(torch.float16).double().cuda() for n, t in inputs.items()}
        kwargs = {} if offsets is None else {"cu_seqlens": torch.tensor(offsets, device="cuda")}
        ref_leaves = {n: t.clone().requires_grad_(True) for n, t in rounded.items()}
        ref_o = naive(**ref_leaves, **kwargs)
        do = torch.randn_like(ref_o).to(torch.float16).double()
        ref_o.backward(do)
        reference = {"o": ref_o.detach()} | {f"d{n}": ref_leaves[n].grad for n in GRADS}
        for algo in ("chunk", "recurrent"):

            def run(algo=algo, kwargs=kwargs, **leaves):
                return fusetune.gated_slot_attention(**leaves, mode=algo, **kwargs)

            errors = max_abs_errors(run, rounded, do, reference)
            cells = " ".join(f"{n} {e:.2e}" for n, e in errors.items())
            print(f"{name:32s} {algo:9s} | {cells}", flush=True)
            print(ROW + json.dumps(dict(mode=mode, case=name, algo=algo, **errors)), flush=True)
    for _, step in bench_steps():  # compiles (into Triton's cache) what ``times`` will time
        step()


def bench_steps():
    """(dtype, step) for an fp16 and a bf16 forward + backward at B4 T4096 H16 D=M=64 (the
    benchmark's shape). FUSETUNE_GSA_DOT acts on fp16 only: bf16 is the control."""
    torch.manual_seed(0)
    inputs = make_inputs(4, 4096, 16, 16, 64, 64, 64, initial_state=False)
    for dtype in (torch.float16, torch.bfloat16):
        leaves = {n: t.to("cuda", dtype).requires_grad_(True) for n, t in inputs.items()}
        do = torch.randn(4, 4096, 16, 64, device="cuda", dtype=dtype)

        def step(leaves=leaves, do=do):
            fusetune.gated_slot_attention(**leaves, mode="chunk").backward(do)

        yield dtype, step


def time_worker() -> None:
    """Median ms of each bench step (compiled already: issue_worker ran them once)."""
    import triton.testing

    for dtype, step in bench_steps():
        ms = triton.testing.do_bench(step)
        print(f"{str(dtype)[6:]} fwd+bwd B4 T4096 H16 D64 M64: {ms:.3f} ms", flush=True)


def spawn(mode: str, role: str) -> subprocess.Popen:
    env = dict(os.environ, FUSETUNE_GSA_DOT=mode)
    return subprocess.Popen(
        [sys.executable, __file__, role],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def print_table(rows: list[dict], modes: list[str]) -> None:
    """The issue's table: per case and algorithm, max abs error of o, dq, dk, dv (the worst of
    them) and of dg, one column pair per precision mode (recurrent mode has no matmul: its
    columns show the run-to-run spread)."""
    cell = {(r["mode"], r["case"], r["algo"]): r for r in rows}
    keys = list(dict.fromkeys((r["case"], r["algo"]) for r in rows))
    head = " | ".join(f"{m + ' o/dq/dk/dv':>20s} {m + ' dg':>11s}" for m in modes)
    print(f"\nfp16 max abs error vs float64 (issue 20, item 4)\n{'case':32s} {'algo':9s} | {head}")
    for case, algo in keys:
        cells = []
        for mode in modes:
            r = cell.get((mode, case, algo))
            if r is None:
                cells.append(f"{'-':>20s} {'-':>11s}")
            else:
                worst = max(r[n] for n in ("o", "dq", "dk", "dv"))
                cells.append(f"{worst:>20.2e} {r['dg']:>11.2e}")
        print(f"{case:32s} {algo:9s} | " + " | ".join(cells), flush=True)


def issue(modes: list[str]) -> None:
    running = {mode: spawn(mode, "issue-worker") for mode in modes}  # compile side by side
    rows = []
    for mode, proc in running.items():
        out, _ = proc.communicate()
        print(
            f"== FUSETUNE_GSA_DOT={mode} (fp16 chunk mode's products of computed fp32 operands; "
            f"recurrent mode has no matmul), exit {proc.returncode}",
            flush=True,
        )
        for line in out.splitlines():
            if line.startswith(ROW):
                rows.append(json.loads(line[len(ROW) :]))
            else:
                print(line, flush=True)
    print_table(rows, modes)


def times(modes: list[str]) -> None:
    for mode in modes:  # one at a time: a timing shares the GPU with nothing
        out, _ = spawn(mode, "time-worker").communicate()
        print(f"== FUSETUNE_GSA_DOT={mode} timing:\n{out.strip()[-800:]}", flush=True)


# ----------------------------------------------------------------------------- steep blocks


def drop_errors(drop: float, seed: int, device: str) -> dict[str, float]:
    torch.manual_seed(seed)
    inputs = make_inputs(batch=1, seq_len=40, q_heads=2, heads=1)
    inputs["g"][:, [18, 27], :, 1::2] = -drop / 2  # the block of tokens 16..31
    inputs["s"] = 1 - inputs["g"].exp()
    rounded = {n: t.float() for n, t in inputs.items()}
    ref = {n: t.double().requires_grad_(True) for n, t in rounded.items()}
    test = {n: t.to(device).requires_grad_(True) for n, t in rounded.items()}
    ref_out = with_states(naive)(**ref)
    test_out = with_states(fusetune.gated_slot_attention, mode="chunk")(**test)
    upstream = [torch.randn_like(o) for o in ref_out]
    torch.autograd.backward(ref_out, upstream)
    torch.autograd.backward(test_out, [u.to(device, torch.float32) for u in upstream])
    result = {
        f"out{i}": relative_error(o.detach().double().cpu(), r.detach())
        for i, (o, r) in enumerate(zip(test_out, ref_out, strict=True))
    }
    result |= {n: relative_error(test[n].grad.double().cpu(), ref[n].grad) for n in ref}
    return result


def drops(args: list[str]) -> None:
    values = [float(d) for d in args] or [10, 20, 30, 40, 50, 55, 59, 61, 70, 100, 1e4]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for drop in values:
        for seed in range(3):
            row = drop_errors(drop, seed, device)
            worst = max(row, key=row.get)
            cells = " ".join(f"{n}={e:.1e}" for n, e in row.items())
            print(
                f"drop {drop:>7g} seed {seed}: worst {worst} {row[worst]:.2e} | {cells}", flush=True
            )


def main() -> None:
    command, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("issue", [])
    if command == "issue":
        issue(args or list(MODES))
    elif command == "times":
        times(args or list(MODES))
    elif command == "issue-worker":
        issue_worker()
    elif command == "time-worker":
        time_worker()
    elif command == "drops":
        drops(args)
    else:
        raise SystemExit(f"unknown command {command!r}: issue|times [mode ...] or drops [drop ...]")


if __name__ == "__main__":
    main()
