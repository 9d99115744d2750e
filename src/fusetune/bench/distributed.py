"""``python -m fusetune bench e2e --nproc N``: training steps on N GPUs under FSDP2, DeepSpeed
ZeRO-3 or DDP (the model whole on every rank), for HF (+ PEFT for LoRA), + Liger-Kernel and +
fusetune, each also on 1 GPU for the scaling efficiency (tokens/s per GPU at N over that at 1,
the same variant and engine).

Each size is a torchrun launch per configuration (``fusetune.bench.distributed_worker`` says
what a launch builds and measures): HF and fusetune share one under FSDP2 (the imports and the
process group paid once, each model freed before the next), Liger (which patches transformers
for the whole process) and ZeRO-3 runs get one each. Where the machine has several GPUs the
1-GPU launches run side by side, one GPU each. A launch that fails gives a row naming its error
(Liger's fused loss on a sharded head, an out-of-memory error, a timeout). Without a GPU:
tiny configs over gloo (ZeRO-3 through DeepSpeed's CPU accelerator), Liger skipped (the
plumbing's smoke run). ZeRO-3 rows need deepspeed installed (not a dependency).

Rows: tokens/s per GPU and peak GiB per GPU (the largest rank's ``max_memory_allocated`` while
training, counted from after the engine sharded the model), the
step's min / median / max ms, fusetune's fused-loss calls against the steps run (warm-up
included), the scaling efficiency. Written to ``e2e-distributed.json`` / ``.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fusetune.bench.cases_e2e import (
    DEFAULT_SHAPES,
    SEQ_LEN,
    SHAPES,
    TINY_BATCH,
    TINY_SEQ_LEN,
    parse_choices,
    profile_lines,
)
from fusetune.finetune.distributed import free_port

VARIANTS = ("hf", "liger", "fusetune", "hf-compiled", "fusetune-compiled", "hf-shard-lora",
            "fusetune-shard-lora", "hf-shard-lora-compiled",
            "fusetune-shard-lora-compiled", "fusetune-graph")  # fmt: skip
DEFAULT_VARIANTS = VARIANTS[:3]  # the others (FSDP2 only) on request
ENGINES = ("fsdp2", "zero3", "ddp")
TAG = "RESULT "
LAUNCH_TIMEOUT_S = 240
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception)): (.*)$")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fusetune bench e2e --nproc N",
        description="Training steps on N GPUs (FSDP2 or DeepSpeed ZeRO-3) against 1 GPU: "
        "HF (+PEFT), + Liger-Kernel, + fusetune; tokens/s and peak GiB per GPU, scaling.",
    )
    parser.add_argument("--nproc", type=gpu_counts, required=True,
                        help="GPUs (ranks) per launch; a list (2,4,8) runs each")  # fmt: skip
    parser.add_argument("--engine", default="fsdp2",
                        help="fsdp2, zero3, ddp (the model whole on every rank) or a comma "
                             "list")  # fmt: skip
    parser.add_argument("--full", action="store_true", help="full fine-tuning")
    parser.add_argument("--lora", action="store_true", help="LoRA (the default; both: both)")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"of {list(SHAPES)}")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help="of hf, liger, fusetune, hf-compiled, fusetune-compiled (each "
                             "decoder layer compiled after sharding; FSDP2 only), "
                             "hf-shard-lora, fusetune-shard-lora (FSDP2 LoRA: the adapters "
                             "replicated, fusetune.integrations.fsdp.shard_lora), and both "
                             "(hf-shard-lora-compiled, fusetune-shard-lora-compiled); "
                             "fusetune-graph (ddp LoRA: fusetune.graph_train_step, the "
                             "gradients averaged inside the graph)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=None, help="per GPU (default: e2e's)")
    parser.add_argument("--seq-len", type=int, default=None, help=f"(default: {SEQ_LEN})")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: the shape's; fewer: a reduced-depth model "
                        "whose full fine-tuning state fits one GPU)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=8, help="timed steps (median; 8)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    parser.add_argument("--timeout", type=float, default=LAUNCH_TIMEOUT_S, help="per launch, s")
    parser.add_argument("--no-single", action="store_true", help="skip the 1-GPU launches")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA time by kernel kind of one more step (rank 0's) beside its "
                             "wall time")  # fmt: skip
    parser.add_argument("--keep-gathered", action="store_true",
                        help="FSDP2: reshard_after_forward=False (each layer's gathered "
                             "parameters kept from its forward to its backward: one all-gather "
                             "a layer a step, not two)")  # fmt: skip
    parser.add_argument("--memory-peak", action="store_true",
                        help="what rank 0 holds at the peak of one more step, by where it was "
                             "allocated (fusetune.bench.memory_peak)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="tiny configs (smoke run)")
    parser.add_argument("--out", default="bench_results", help="folder for results and logs")
    return parser


def gpu_counts(text: str) -> list[int]:
    """``--nproc``: "4" or "2,4,8", each a positive count, in increasing order."""
    try:
        counts = sorted({int(part) for part in text.split(",")})
    except ValueError:
        message = f"not a count or a comma list of counts: {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if counts[0] < 1:
        raise argparse.ArgumentTypeError(f"GPU counts must be positive: {text!r}")
    return counts


def jobs(args: argparse.Namespace, tiny: bool) -> list[dict[str, Any]]:
    """One job per shape x engine x mode x variant, in that order (the first are kept when a
    time limit cuts the run)."""
    modes = [m for m, on in (("full", args.full), ("lora", args.lora)) if on] or ["lora"]
    found = []
    for key, engine, mode, variant in itertools.product(
        parse_choices(args.shapes, SHAPES, "--shapes"),
        parse_choices(args.engine, ENGINES, "--engine"),
        modes,
        parse_choices(args.variants, VARIANTS, "--variants"),
    ):
        batch = args.batch or (TINY_BATCH if tiny else SHAPES[key].batch)
        seq_len = args.seq_len or (TINY_SEQ_LEN if tiny else SEQ_LEN)
        job = dict(engine=engine, mode=mode, shape=key, variant=variant, batch=batch)
        found.append({**job, "seq_len": seq_len, "steps": args.steps, "warmup": args.warmup,
                      "tiny": tiny, "layers": args.layers, "profile": args.profile,
                      "keep_gathered": args.keep_gathered,
                      "memory_peak": args.memory_peak})  # fmt: skip
    return found


def not_run(job: dict[str, Any], cuda: bool) -> str | None:
    """Why a job cannot run here (a note, not an error), or None."""
    if not cuda and job["variant"] == "liger":
        return "skipped: Liger-Kernel needs CUDA"
    if job["engine"] != "fsdp2" and job["variant"].endswith("-compiled"):
        return "skipped: the compiled variants run under FSDP2"
    if job["variant"] == "fusetune-graph" and (job["engine"], job["mode"]) != ("ddp", "lora"):
        return "skipped: the graphed step is the ddp engine's, for LoRA"
    if job["variant"] == "fusetune-graph" and not cuda:
        return "skipped: a CUDA graph needs a GPU"
    lora_fsdp2 = (job["engine"], job["mode"]) == ("fsdp2", "lora")
    if "-shard-lora" in job["variant"] and not lora_fsdp2:
        return "skipped: shard_lora is FSDP2 for LoRA"
    if job["engine"] == "zero3" and importlib.util.find_spec("deepspeed") is None:
        return "skipped: deepspeed is not installed (not a dependency)"
    return None


# ----------------------------------------------------------------------------- launches


class Launch:
    """One torchrun group in its own session (so a timeout ends every rank), output to a log;
    ``jobs``: variants of one engine, mode and shape, run one after the other."""

    live: set[Launch] = set()  # ended on SIGTERM (the caller's `timeout`): no orphan on a GPU

    def __init__(self, jobs: list[dict[str, Any]], nproc: int, port: int, log: Path,
                 gpus: str | None):  # fmt: skip
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={port}",
                   "-m", "fusetune.bench.distributed_worker", json.dumps(jobs)]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        self.jobs, self.nproc, self.log = jobs, nproc, log
        self.started = time.monotonic()
        with open(log, "w") as sink:
            sink.write(f"$ {' '.join(command)}\n")
            sink.flush()
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)  # fmt: skip
        Launch.live.add(self)

    def kill(self) -> None:
        """End the group: torchrun forwards SIGTERM to its ranks (each in a process group of
        its own); whatever is left after a few seconds, the ranks included, gets SIGKILL."""
        ranks = _children(self.process.pid)
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        Launch.live.discard(self)

    def wait(self, timeout_s: float) -> list[dict[str, Any]]:
        left = max(1.0, timeout_s - (time.monotonic() - self.started))
        try:
            code = self.process.wait(timeout=left)
            failure = f"exit status {code}" if code else None
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout_s:.0f} s"
        self.kill()  # a timed-out group, or ranks a failed one left behind
        text = self.log.read_text(errors="replace")
        return [
            {**job, "nproc": self.nproc, "log": self.log.name, **parse_output(text, failure, job)}
            for job in self.jobs
        ]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc; none elsewhere)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _end_live_launches(signum, frame) -> None:
    for launch in list(Launch.live):
        launch.kill()
    raise SystemExit(128 + signum)


def parse_output(text: str, failure: str | None, job: dict[str, Any]) -> dict[str, Any]:
    """``job``'s result in a launch's output: its RESULT line (rank 0's measurement, or the
    error of the first rank that failed), else an error naming what went wrong (the last
    ``XError: message`` line, else ``failure``)."""
    mine = [r for r in tagged(text) if r.get("variant", job["variant"]) == job["variant"]]
    errors = [r for r in mine if "error" in r]
    if errors:
        return {"error": errors[0]["error"]}
    if mine:
        return {k: v for k, v in mine[-1].items() if k != "variant"}
    named = [m for m in map(ERROR_LINE.match, text.splitlines()) if m]
    torchrun_own = ("ChildFailedError", "SignalException")  # its summary, our SIGTERM
    named = [m for m in named if not m.group(1).endswith(torchrun_own)]
    if named:
        why = f"{named[-1].group(1)}: {named[-1].group(2).strip()}"[:300]
        return {"error": f"{why} ({failure})" if failure and "timed out" in failure else why}
    return {"error": failure or "no RESULT line"}


def tagged(text: str) -> list[dict[str, Any]]:
    """Every ``RESULT {json}`` in ``text``, also where two ranks' lines ran into one."""
    decoder, found = json.JSONDecoder(), []
    for match in re.finditer(re.escape(TAG) + r"(?=\{)", text):
        with contextlib.suppress(json.JSONDecodeError):
            found.append(decoder.raw_decode(text, match.end())[0])
    return found


def launch_units(group: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The launches of one configuration: under FSDP2 or DDP the variants other than Liger
    share one (a process group and the imports paid once; fusetune runs after HF, its patches
    are per model), Liger (which patches transformers for the whole process) and every ZeRO-3
    run (DeepSpeed does not hand back an engine's memory) get one each."""
    shared = [j for j in group if j["engine"] != "zero3" and j["variant"] != "liger"]
    alone = [[j] for j in group if j not in shared]
    return ([shared] if shared else []) + alone


def run_all(args: argparse.Namespace, on_row) -> list[dict[str, Any]]:
    """Every job at 1 GPU (side by side where the machine has several) then at each --nproc."""
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    tiny = args.tiny or not cuda
    out = Path(args.out)
    ports = iter(free_port, None)  # a fixed port collided with another job's launch
    rows: list[dict[str, Any]] = []
    signal.signal(signal.SIGTERM, _end_live_launches)

    def finish(row: dict[str, Any]) -> None:
        rows.append(row)
        print(f"[e2e --nproc] {describe(row)} = {brief(row)}", file=sys.stderr, flush=True)
        on_row(rows)

    for group in _groups(jobs(args, tiny)):
        runnable = []
        for job in group:
            why = not_run(job, cuda)
            if why:
                finish({**job, "nproc": args.nproc[-1], "note": why})
            else:
                runnable.append(job)
        sizes = sorted(set(args.nproc) | (set() if args.no_single else {1}))
        for nproc in sizes:
            side_by_side = max(1, gpus // nproc) if cuda else 1
            for wave in _chunks(launch_units(runnable), side_by_side):
                launches = []
                for slot, unit in enumerate(wave):
                    devices = _devices(slot, nproc) if cuda and len(wave) > 1 else None
                    names = "+".join(job["variant"] for job in unit)
                    log = out / f"launch-{_name(unit[0])}-{names}-n{nproc}.log"
                    print(f"[e2e --nproc] {describe({**unit[0], 'variant': names, 'nproc': nproc})}"
                          " ...", file=sys.stderr, flush=True)  # fmt: skip
                    launches.append(Launch(unit, nproc, next(ports), log, devices))
                for launch in launches:
                    for row in launch.wait(args.timeout):
                        finish(row)
    return rows


def _groups(found: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Jobs grouped by shape, engine and mode (the variants compared in one table block)."""
    key = lambda job: (job["shape"], job["engine"], job["mode"])  # noqa: E731
    return [list(group) for _, group in itertools.groupby(found, key)]


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _devices(slot: int, nproc: int) -> str:
    return ",".join(str(slot * nproc + i) for i in range(nproc))


def _name(job: dict[str, Any]) -> str:
    return f"{job['engine']}-{job['mode']}-{job['shape']}"


# ----------------------------------------------------------------------------- table


def with_scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with ``efficiency``: its tokens/s per GPU over the 1-GPU row of the same
    engine, mode, shape and variant (None where either is missing)."""
    key = lambda r: (r["engine"], r["mode"], r["shape"], r["variant"])  # noqa: E731
    single = {key(r): r.get("tokens_per_s_per_gpu") for r in rows if r["nproc"] == 1}
    done = []
    for row in rows:
        base, tps = single.get(key(row)), row.get("tokens_per_s_per_gpu")
        efficiency = tps / base if tps and base and row["nproc"] > 1 else None
        done.append({**row, "efficiency": efficiency})
    return done


HEADER = ("engine", "mode", "shape", "variant", "GPUs", "tok/s/GPU", "peak GiB/GPU",
          "step ms min/med/max", "fused calls", "scaling", "note")  # fmt: skip


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [_cells(row) for row in with_scaling(rows)]
    widths = [max(len(x) for x in column) for column in zip(HEADER, *lines, strict=True)]
    right = {4, 5, 6, 7, 8, 9}

    def render(cells) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in pairs).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(HEADER), rule, *(render(line) for line in lines)])


def _cells(row: dict[str, Any]) -> tuple[str, ...]:
    timed = "step_ms" in row
    keys = ("step_ms_min", "step_ms", "step_ms_max")
    steps = "/".join(f"{row[k]:.0f}" for k in keys) if timed else "-"
    counted = timed and row["variant"].startswith("fusetune")
    calls = f"{row['fused_calls']}/{row['steps']}" if counted else "-"
    peak = row.get("peak_gib_per_gpu")
    note = ("ERROR " + row["error"]) if row.get("error") else row.get("note", "")
    warned = row.get("fallback_warnings")
    if warned:  # one per module: the count and the first says it
        more = f" (and {len(warned) - 1} more)" if len(warned) > 1 else ""
        note = (note + " " if note else "") + f"WARNED {warned[0][:200]}{more}"
    return (
        row["engine"],
        row["mode"],
        shape_name(row),
        _variant_name(row),
        str(row["nproc"]),
        f"{row['tokens_per_s_per_gpu']:,.0f}" if timed else "-",
        f"{peak:.2f}" if peak is not None else "-",
        steps,
        calls,
        f"{row['efficiency']:.0%}" if row.get("efficiency") else "-",
        note,
    )


def shape_name(row: dict[str, Any]) -> str:
    name = SHAPES[row["shape"]].name
    if row.get("layers"):
        name += f", {row['layers']} layer" + "s" * (row["layers"] != 1)
    return name + (" (tiny)" if row.get("tiny") else "")


def _variant_name(row: dict[str, Any]) -> str:
    variant = row["variant"]
    base, compiled = variant.removesuffix("-compiled"), variant.endswith("-compiled")
    replicated = base.endswith("-shard-lora")
    base = base.removesuffix("-shard-lora")
    if row["mode"] == "lora":
        base = "hf+peft" if base == "hf" else f"hf+peft+{base}"
    suffixes = [", adapters replicated"] * replicated + [", compiled"] * compiled
    suffixes += [", kept gathered"] * bool(row.get("keep_gathered"))
    return base + "".join(suffixes)


def describe(row: dict[str, Any]) -> str:
    return f"{row['engine']} {row['mode']} {row['shape']} {row['variant']} x{row['nproc']}"


def brief(row: dict[str, Any]) -> str:
    if row.get("error"):
        return "ERROR " + row["error"]
    if "step_ms" not in row:
        return row.get("note", "-")
    peak = row.get("peak_gib_per_gpu")
    memory = f", {peak:.2f} GiB/GPU" if peak is not None else ""
    return f"{row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, {row['step_ms']:.1f} ms{memory}"


def main(argv: list[str] | None = None) -> int:
    """0, or 1 when a fusetune launch failed or fell back to the logits path."""
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict[str, Any]]) -> None:
        data = {"argv": argv if argv is not None else sys.argv[1:], "rows": with_scaling(rows)}
        (out / "e2e-distributed.json").write_text(json.dumps(data, indent=2) + "\n")
        # the table so far too: a run its caller's timeout cuts keeps what it measured
        (out / "e2e-distributed.txt").write_text(format_table(rows) + "\n")

    rows = run_all(args, save)
    print(format_table(rows), flush=True)
    for row in rows:  # where the step's time goes: CUDA kinds against the wall step
        for line in profile_lines({**row, "variant": f"{_variant_name(row)} x{row['nproc']}"}):
            print(line, flush=True)
        if row.get("memory_peak"):
            print(f"{_variant_name(row)} x{row['nproc']}, rank 0:", flush=True)
            print("\n".join(row["memory_peak"]), flush=True)
    bad = [r for r in rows if r["variant"].startswith("fusetune") and not_fused(r)]
    return 1 if bad else 0


def not_fused(row: dict[str, Any]) -> bool:
    if row.get("note"):
        return False
    return bool(row.get("error") or row.get("fallback_warnings")) or (
        row["fused_calls"] != row["steps"]
    )
