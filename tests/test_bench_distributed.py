"""``python -m fusetune bench e2e --nproc N``: the table, the scaling efficiency and the error
rows from made-up launch outputs, and the whole command on 2 ranks of a tiny model (gloo on the
CPU, NCCL on 2 GPUs): a torchrun launch per size, the fused loss on every step."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import fusetune
from fusetune.bench import distributed
from fusetune.cli import main as cli_main

pytest.importorskip("peft")
JOB = dict(engine="fsdp2", mode="full", shape="llama-3.2-1b", variant="fusetune", tiny=False)
TIMED = dict(step_ms=100.0, step_ms_min=95.0, step_ms_max=130.0, peak_gib_per_gpu=20.5,
             fused_calls=11, steps=11, fallback_warnings=[])  # fmt: skip


def row(variant: str, nproc: int, tokens: float | None = None, **extra) -> dict:
    timed = {} if tokens is None else {**TIMED, "tokens_per_s_per_gpu": tokens}
    return {**JOB, "variant": variant, "nproc": nproc, **timed, **extra}


def test_scaling_is_per_gpu_throughput_over_one_gpu_of_the_same_variant():
    rows = [row("hf", 1, 40_000.0), row("fusetune", 1, 50_000.0), row("hf", 2, 38_000.0),
            row("fusetune", 2, 47_500.0), row("liger", 2, error="X")]  # fmt: skip
    scaled = {(r["variant"], r["nproc"]): r["efficiency"] for r in distributed.with_scaling(rows)}
    assert scaled[("hf", 2)] == pytest.approx(0.95)
    assert scaled[("fusetune", 2)] == pytest.approx(0.95)
    assert scaled[("hf", 1)] is None and scaled[("liger", 2)] is None


def test_table_has_error_rows_calls_and_scaling():
    liger_error = "RuntimeError: aten.mm.default: got mixed torch.Tensor and DTensor"
    rows = [row("fusetune", 1, 50_000.0), row("fusetune", 2, 45_000.0),
            row("liger", 2, error=liger_error),
            row("fusetune", 2, 45_000.0, shape="qwen2.5-0.5b", fused_calls=0,
                fallback_warnings=["fusetune: lm_head is X", "fusetune: Y"])]  # fmt: skip
    lines = distributed.format_table(rows).splitlines()
    assert lines[0].split()[:4] == ["engine", "mode", "shape", "variant"]
    assert "90%" in lines[3] and "11/11" in lines[3] and "95/100/130" in lines[3]
    assert "45,000" in lines[3] and "20.50" in lines[3]
    assert "ERROR " + liger_error in lines[4] and "liger" in lines[4]
    assert "0/11" in lines[5] and "WARNED fusetune: lm_head is X (and 1 more)" in lines[5]
    assert distributed.not_fused(rows[3]) and not distributed.not_fused(rows[1])


def test_parse_output_names_the_error():
    hf, fusetune = {**JOB, "variant": "hf"}, JOB
    result = {"variant": "fusetune", "tokens_per_s_per_gpu": 1.0}
    text = f'noise\nRESULT {{"variant": "hf", "error": "E: x"}}\nRESULT {json.dumps(result)}\n'
    # the launch's variants each find their own line
    assert distributed.parse_output(text, "exit status 1", fusetune) == {
        "tokens_per_s_per_gpu": 1.0
    }
    assert distributed.parse_output(text, "exit status 1", hf) == {"error": "E: x"}
    # two ranks' error lines run into one; a cut-off line is skipped
    text = 'RESULT {"variant": "hf", "error": "E: x"}RESULT {"variant": "hf", "error": "E: x"}\n'
    assert distributed.parse_output(text + 'RESULT {"varia\n', None, hf) == {"error": "E: x"}
    # a rank's own error line wins over torchrun's summary
    own = 'RESULT {"variant": "fusetune", "error": "OutOfMemoryError: CUDA out of memory"}\n'
    text = own + "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: boom\n"
    assert distributed.parse_output(text, "exit status 1", fusetune) == {
        "error": "OutOfMemoryError: CUDA out of memory"
    }
    # a crash before the worker's try: the last XError line (rank prefix dropped)
    text = "Traceback\n[rank1]: ImportError: No module named 'deepspeed'\n"
    assert distributed.parse_output(text, "exit status 1", fusetune) == {
        "error": "ImportError: No module named 'deepspeed'"
    }
    assert distributed.parse_output("hang\n", "timed out after 9 s", hf) == {
        "error": "timed out after 9 s"
    }


def test_launches_share_a_process_only_under_fsdp2_and_without_liger():
    group = [{**JOB, "variant": v} for v in ("hf", "liger", "fusetune")]
    units = distributed.launch_units(group)
    assert [[j["variant"] for j in unit] for unit in units] == [["hf", "fusetune"], ["liger"]]
    zero3 = [{**job, "engine": "zero3"} for job in group]
    assert [len(unit) for unit in distributed.launch_units(zero3)] == [1, 1, 1]
    ddp = [{**job, "engine": "ddp"} for job in group]
    assert [len(unit) for unit in distributed.launch_units(ddp)] == [2, 1]


def test_jobs_order_and_choices():
    args = distributed.build_parser().parse_args(
        ["--nproc", "2", "--engine", "fsdp2,zero3", "--full", "--lora", "--shapes", "qwen2.5-0.5b"]
    )
    found = distributed.jobs(args, tiny=True)
    assert [(j["engine"], j["mode"], j["variant"]) for j in found[:4]] == [
        ("fsdp2", "full", "hf"), ("fsdp2", "full", "liger"), ("fsdp2", "full", "fusetune"),
        ("fsdp2", "lora", "hf"),
    ]  # fmt: skip
    assert len(found) == 2 * 2 * 3 and found[0]["batch"] == 2
    zero3 = {**found[0], "engine": "zero3"}
    missing = importlib.util.find_spec("deepspeed") is None
    assert (distributed.not_run(zero3, cuda=True) is not None) == missing  # an honest skip
    assert distributed.not_run({**found[1], "engine": "fsdp2"}, cuda=False).startswith("skipped")
    compiled = {**zero3, "variant": "fusetune-compiled"}
    assert distributed.not_run(compiled, cuda=True).endswith("run under FSDP2")
    assert distributed._variant_name({**found[3], "variant": "hf-compiled"}) == "hf+peft, compiled"
    replicated = {**found[3], "variant": "fusetune-shard-lora"}
    assert distributed.not_run(replicated, cuda=True) is None
    assert distributed.not_run({**replicated, "mode": "full"}, cuda=True).endswith("for LoRA")
    assert distributed._variant_name(replicated) == "hf+peft+fusetune, adapters replicated"
    hf_replicated = {**replicated, "variant": "hf-shard-lora"}
    assert distributed._variant_name(hf_replicated) == "hf+peft, adapters replicated"
    both = {**replicated, "variant": "fusetune-shard-lora-compiled"}
    assert distributed.not_run({**both, "mode": "full"}, cuda=True).endswith("for LoRA")
    assert distributed._variant_name(both) == "hf+peft+fusetune, adapters replicated, compiled"
    graph = {**found[3], "engine": "ddp", "variant": "fusetune-graph"}
    assert distributed.not_run(graph, cuda=True) is None
    assert distributed.not_run(graph, cuda=False).endswith("a CUDA graph needs a GPU")
    assert distributed.not_run({**graph, "engine": "fsdp2"}, cuda=True).endswith("for LoRA")
    ddp_compiled = {**graph, "variant": "fusetune-compiled"}
    assert distributed.not_run(ddp_compiled, cuda=True).endswith("run under FSDP2")
    args.variants = "hf,nope"
    with pytest.raises(SystemExit, match="--variants: unknown"):
        distributed.jobs(args, tiny=True)


LAYOUTS = {"fsdp2-full": ["--engine", "fsdp2", "--full", "--memory-peak"],
           "ddp-lora": ["--engine", "ddp"]}  # fmt: skip


@pytest.mark.skipif(
    torch.cuda.device_count() == 1,
    reason="2 ranks need 2 GPUs (NCCL) or none (gloo on the CPU): see test_distributed.py",
)
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_command_on_two_ranks(tmp_path, capsys, layout):
    """Full fine-tuning of the tiny Llama under FSDP2, its head sharded on its own (with
    --memory-peak: one more step on GPUs), and LoRA with the model whole on every rank (DDP; on
    GPUs also graphed): the 1-rank and the 2-rank launch both give a row with the fused loss on
    every step that runs the model's Python (a graphed step: its eager steps and the capture)
    and a scaling efficiency."""
    graphed = layout[1] == "ddp" and torch.cuda.is_available()
    variants = "fusetune,fusetune-graph" if graphed else "fusetune"
    argv = ["bench", "e2e", "--nproc", "2", "--tiny", *layout, "--variants", variants,
            "--shapes", "llama-3.2-1b", "--steps", "1", "--warmup", "1", "--seq-len", "16",
            "--out", str(tmp_path)]  # fmt: skip
    code = cli_main(argv)
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "e2e-distributed.json").read_text())["rows"]
    assert sorted(r["nproc"] for r in rows) == [1, 2] * (1 + graphed), rows
    for got in rows:
        assert "error" not in got, (got, (tmp_path / got["log"]).read_text()[-3000:])
        eager = got["variant"] != "fusetune-graph"
        traced = "--memory-peak" in layout and torch.cuda.is_available()
        assert got["fused_calls"] == got["steps"] == (2 + traced if eager else 4), got
        assert got["fallback_warnings"] == [] and got["world"] == got["nproc"]
    assert all(r["efficiency"] > 0 for r in rows if r["nproc"] == 2) and code == 0
    assert "fusetune" in printed and ("2/2" in printed or "3/3" in printed)
    if "--memory-peak" in layout:  # rank 0's lines, at 1 and 2 ranks
        from fusetune.bench import memory_peak

        want = "peak of one step" if torch.cuda.is_available() else memory_peak.NOT_CUDA
        assert printed.count(want) == 2, printed


def test_compiled_variants_compile_each_decoder_layer():
    """hf-compiled / fusetune-compiled: every decoder layer compiled on its own (after FSDP2
    sharded it; the launch itself runs in the GPU pass), the stack and the head left eager."""
    from fusetune.bench import distributed_worker

    job = {"shape": "llama-3.2-1b", "tiny": True, "variant": "fusetune-compiled", "mode": "lora",
           "engine": "fsdp2"}  # fmt: skip
    model = distributed_worker.build(job, torch.device("cpu"))
    distributed_worker.compile_each_layer(model, torch.device("cpu"))
    layers = model.get_base_model().model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert model.get_base_model().model._compiled_call_impl is None
    fusetune.revert(model)


def test_profile_lines_show_cuda_time_against_the_wall_step():
    """--profile: the CUDA time by kind is printed beside the step's wall time (the gap is
    host time), and the top kernels under it."""
    from fusetune.bench.cases_e2e import profile_lines

    profile = {"kinds_ms": {"matmul": 60.0, "triton": 15.5}, "wall_ms": 171.0,
               "top": [{"ms": 20.0, "calls": 16, "kernel": "nvjet_gemm"}],
               "syncs": {"cudaStreamSynchronize": 2}}  # fmt: skip
    row = {"shape": "llama-3.2-1b", "batch": 4, "variant": "fusetune x2", "profile": profile}
    lines = profile_lines(row)
    assert "CUDA 75.5 ms in a 171.0 ms step" in lines[0] and "matmul 60.0" in lines[0]
    assert lines[1].strip() == "host waits for the GPU: cudaStreamSynchronize x2"
    assert "nvjet_gemm" in lines[2] and profile_lines({**row, "profile": None}) == []
    quiet = {**row, "profile": {**profile, "syncs": {}}}
    assert "waits for the GPU: none" in profile_lines(quiet)[1]
