"""Gated DeltaNet's bf16 products on the GPU, a fault probe: each FUSETUNE_GDR_W level at three
shapes, each case in its own process under CUDA_LAUNCH_BLOCKING=1 (a fault poisons its process's
context; the traceback names the launch), repeated within the process, every repeat's outputs
and gradients checked against the level-0 result (fp32 W, tf32). One line per case. (It found
the H100 faults of the bf16 products, 2026-11-27, and chose their work-around: gdr_chunk's note
above ``mm_state``.)

    PYTHONPATH=src:tests:tools python tools/gdr_fault_probe.py matrix [--repeats 5]

Shapes: B4 T4096 and B1 T32768 with the bench's inputs (H16 D128, raw q, k with l2norm, fp32 g,
bf16 beta: the sweep's faults), and B2 T700 with test_strong_decays_gpu's (two key heads, four
value heads, K = V = 128, decay rates to 16, an initial state, the final state out, l2norm; its
bf16 output was garbage). The shapes run side by side (one chain of processes each, so three
processes share the GPU at a time, as the test suite's xdist workers did); within a shape the
level-0 reference runs first and saves its results, then each case loads them. Cases: levels w
and auto; then two diagnoses for each: DISABLE_MMA_V3=1 (mma.sync everywhere: whether a fault
needs wgmma) and states / dstates at 4 warps (every fault was in an 8-warp launch of them).
Then, when a case faulted and ``compute-sanitizer`` exists, the first faulting case once more
(one repeat) under memcheck, instrumenting only the states kernels.

    PYTHONPATH=src:tests:tools python tools/gdr_fault_probe.py case SHAPE LEVEL DIR [N]

runs one case (what ``matrix`` starts; SHAPE is b4t4096 | b1t32768 | b2t700; level fp32 saves
the reference into DIR).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# (batch, T, heads, head dim); "tiny" is for a smoke run of this script on the CPU
# (GDR_PROBE_DEVICE=cpu FUSETUNE_INTERPRET=1 ... matrix --shapes tiny --repeats 1)
SHAPES = {
    "b4t4096": (4, 4096, 16, 128),
    "b1t32768": (1, 32768, 16, 128),
    "b2t700": (2, 700, 4, 128),
    "tiny": (1, 40, 2, 32),
}
DEVICE = os.environ.get("GDR_PROBE_DEVICE", "cuda")
LEVELS = ("w", "auto")
TIMEOUT = 150  # seconds a case process may take (compiles included)
BAD = 0.05  # relative error (norm) that no bf16 rounding reaches (the tests allow 1e-2)


def strong_decay_inputs(device):
    """test_strong_decays_gpu's inputs (its ``make_inputs`` call, seeded), cast to bf16 as
    check_op casts them, and cotangents for the output and the final state."""
    import torch

    from test_gated_delta_rule import make_inputs

    torch.manual_seed(0)
    inputs = make_inputs(batch=2, seq_len=700, key_heads=2, value_heads=4, key_dim=128,
                         value_dim=128, unit_keys=False, decay_scale=16.0)  # fmt: skip
    leaves = {n: t.to(device, torch.bfloat16).requires_grad_() for n, t in inputs.items()}
    cotangents = [torch.randn_like(inputs["v"]), torch.randn_like(inputs["h0"])]
    return leaves, [c.to(device, torch.bfloat16) for c in cotangents]


def make_case(shape: str):
    """(run: one fwd+bwd -> {name: tensor}) for a shape, inputs seeded (the same in every
    process)."""
    import torch

    import fusetune

    device = torch.device(DEVICE)
    if shape == "b2t700":
        leaves, (d_o, d_state) = strong_decay_inputs(device)

        def run():
            for leaf in leaves.values():
                leaf.grad = None
            o, state = fusetune.gated_delta_rule(
                *(leaves[n] for n in ("q", "k", "v", "g", "beta")), initial_state=leaves["h0"],
                output_final_state=True, use_qk_l2norm_in_kernel=True, mode="chunk",
            )  # fmt: skip
            ((o.float() * d_o.float()).sum() + (state.float() * d_state.float()).sum()).backward()
            return {"o": o, "state": state} | {f"d{n}": t.grad for n, t in leaves.items()}

        return run
    from fusetune.bench.cases_gated_delta_rule import _inputs

    batch, seq_len, heads, dim = SHAPES[shape]
    torch.manual_seed(0)
    leaves = _inputs(batch, seq_len, heads, dim, torch.bfloat16, device)
    grad_out = torch.randn(batch, seq_len, heads, dim, device=device, dtype=torch.bfloat16)

    def run():
        for leaf in leaves:
            leaf.grad = None
        o = fusetune.gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)[0]
        o.backward(grad_out)
        return {"o": o} | {f"d{n}": t.grad for n, t in zip("qkvgb", leaves, strict=True)}

    return run


def seq_warps(warps: int) -> None:
    """Launch states_kernel and dstates_kernel at ``warps`` warps (the launcher looks them up in
    gdr_chunk at every call), as tools/gdr_launch_sweep.py's rows do."""
    from gdr_launch_sweep import Override

    from fusetune.ops.linear_attention import gdr_chunk

    for name in ("states_kernel", "dstates_kernel"):
        setattr(gdr_chunk, name, Override(getattr(gdr_chunk, name), num_warps=warps))


def relative_error(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not bool(out.isfinite().all()):
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def case(shape: str, level: str, directory: str, repeats: int) -> None:
    """One process: ``repeats`` fwd+bwd at ``shape``, each checked against the saved level-0
    result (level fp32 saves it); prints one line."""
    os.environ["FUSETUNE_GDR_W"] = level
    import torch

    tag = f"{shape:9s} level {level:4s}"
    if os.environ.get("DISABLE_MMA_V3"):
        tag += " DISABLE_MMA_V3=1"
    warps = os.environ.get("GDR_PROBE_SEQ_WARPS")
    if warps:  # a diagnosis, not a fix: the launcher runs dstates (and states where its
        # programs are fewer than the SMs) at 8 warps; every fault so far was in such a launch
        tag += f" states/dstates at {warps} warps"
        seq_warps(int(warps))
    reference_file = os.path.join(directory, f"ref_{shape}.pt")
    start = time.time()
    worst: dict[str, float] = {}
    clean = 0
    try:
        run = make_case(shape)
        reference = None if level == "fp32" else torch.load(reference_file, map_location=DEVICE)
        for repeat in range(repeats):
            result = run()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            if reference is None:  # the level-0 run: its own first repeat is the reference
                reference = {name: t.detach().clone() for name, t in result.items()}
                torch.save({n: t.cpu() for n, t in reference.items()}, reference_file)
            errors = {n: relative_error(result[n], reference[n]) for n in reference}
            for name, error in errors.items():
                worst[name] = max(worst.get(name, 0.0), error)
            if max(errors.values()) > BAD:
                name = max(errors, key=errors.get)
                print(f"{tag}: BAD at repeat {repeat + 1}: {name} relative error "
                      f"{errors[name]:.3g} ({time.time() - start:.0f} s)", flush=True)  # fmt: skip
                return
            clean += 1
    except Exception as error:  # noqa: BLE001 (the point is the traceback)
        frames = [f.strip() for f in traceback.format_exc().splitlines() if "_kernel[" in f]
        where = frames[-1] if frames else "?"
        print(f"{tag}: FAULT after {clean} clean repeats at {where}: {type(error).__name__}: "
              f"{str(error).splitlines()[0][:90]}", flush=True)  # fmt: skip
        sys.exit(3)
    summary = " ".join(f"{n} {e:.1e}" for n, e in worst.items())
    print(f"{tag}: ok {repeats}/{repeats}, worst relative error vs level 0: {summary} "
          f"({time.time() - start:.0f} s)", flush=True)  # fmt: skip


def chain(shape: str, directory: str, repeats: int, lines: list, faults: list) -> None:
    """One shape's cases in order: the reference, then each level (and diagnosis), each its own
    process."""
    cases = [("fp32", {})] + [(level, {}) for level in LEVELS]
    cases += [(level, {"DISABLE_MMA_V3": "1"}) for level in LEVELS]
    cases += [(level, {"GDR_PROBE_SEQ_WARPS": "4"}) for level in LEVELS]
    for level, extra in cases:
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", **extra)
        command = [sys.executable, __file__, "case", shape, level, directory, str(repeats)]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)
            text = done.stdout.strip() or f"{shape} level {level}: no output, rc " + (
                f"{done.returncode}: {done.stderr.strip().splitlines()[-1:] or ''}"
            )
            code = done.returncode
        except subprocess.TimeoutExpired:
            text, code = f"{shape} level {level}: timed out ({TIMEOUT} s)", -1
        print(text, flush=True)
        lines.append(text)
        if code != 0 or "BAD" in text:
            faults.append((shape, level, extra, text))
        if level == "fp32" and code != 0:
            print(f"{shape}: no reference, its cases skipped", flush=True)
            return


def sanitize(shape: str, level: str, extra: dict, directory: str) -> None:
    """The case once under compute-sanitizer's memcheck (states and dstates kernels only)."""
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        print("compute-sanitizer: not on this machine", flush=True)
        return
    command = [tool, "--tool", "memcheck", "--kernel-name", "kns=states_kernel",
               "--print-limit", "8", sys.executable, __file__, "case", shape, level,
               directory, "1"]  # fmt: skip
    print(f"compute-sanitizer on {shape} level {level} {extra or ''}:", flush=True)
    try:
        done = subprocess.run(command, env=dict(os.environ, **extra), capture_output=True,
                              text=True, timeout=90)  # fmt: skip
        output = (done.stdout + done.stderr).splitlines()
    except subprocess.TimeoutExpired as error:
        output = ((error.stdout or b"").decode(errors="replace") + " [timed out]").splitlines()
    keep = [line for line in output if "=====" in line or "FAULT" in line or "BAD" in line]
    print("\n".join((keep or output)[:40]), flush=True)


def matrix(repeats: int, shapes: list[str]) -> None:
    directory = tempfile.mkdtemp(prefix="gdr_probe_")
    start = time.time()
    lines: list[str] = []
    faults: list = []
    threads = [threading.Thread(target=chain, args=(s, directory, repeats, lines, faults))
               for s in shapes]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"--- {len(lines)} cases, {len(faults)} faulted or wrong, {time.time() - start:.0f} s")
    for line in sorted(lines):
        print(line)
    faulted = [f for f in faults if "FAULT" in f[3]]
    if faulted:
        sanitize(*faulted[0][:3], directory)
    shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("matrix")
    m.add_argument("--repeats", type=int, default=5)
    m.add_argument("--shapes", nargs="+", default=list(SHAPES)[:3], choices=list(SHAPES))
    c = sub.add_parser("case")
    c.add_argument("shape", choices=list(SHAPES))
    c.add_argument("level", choices=("fp32",) + LEVELS)
    c.add_argument("directory")
    c.add_argument("repeats", type=int, nargs="?", default=5)
    args = parser.parse_args()
    if args.command == "matrix":
        matrix(args.repeats, args.shapes)
    else:
        case(args.shape, args.level, args.directory, args.repeats)


if __name__ == "__main__":
    main()
