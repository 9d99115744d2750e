"""``python -m fusetune grpo`` under ``torchrun --nproc-per-node 2``: TRL's GRPOTrainer runs on
both ranks through accelerate (DDP; gloo on the CPU, NCCL on 2 GPUs), each rank on its share of
every step's prompts (TRL's sampler: the same seeded global order, one slice a rank); rank 0
prints and writes the output; ``--batch-size`` stays the global batch.

A sampled step cannot equal a one-process step: each rank draws its completions from its own
generator, seeded as the single process is but drawing for fewer rows, so the completions (and
the rewards, advantages and loss) differ. Near-greedy sampling (temperature 1e-4) removes the
draw: the first step's reward, over the same global prompts, then equals the single process's.
Subprocesses without the interpreter switch, as a user runs them (CPU: the reference path).

``--fsdp`` shards with accelerate's FSDP2 plugin, which accelerate 1.15 turns on for multi-GPU
runs only: on CPU ranks (gloo) it would run DDP, so the command stops with the reason (checked
on the CPU); on 2 GPUs the FSDP2 run is checked against one process as above, with the
parameters really sharded, TRL's head served by fusetune and a consolidated adapter saved.
The head's numbers on sharded weights (gradients included) are tests/test_trl_fsdp.py's.

``--zero3`` hands the model to DeepSpeed ZeRO-3 (every parameter partitioned). It runs on CPU
ranks too (DeepSpeed's CPU accelerator, gloo; the command sets accelerate's state up, which
finds no backend for DeepSpeed without a GPU) and on 2 GPUs (NCCL): the same tests, where
deepspeed is installed (not a dependency; carried to the GPU machine). Against the same command
under DDP, sampling as it does (each rank's generator seeded alike under both engines, the
completions are the same): per-step rewards, losses, KL, entropy and gradient norms agree,
TRL's head runs through fusetune on every call, and the output is whole."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() == 1, reason="2 ranks need 2 GPUs (NCCL) or none (gloo)"
)
COMMAND = ["-m", "fusetune", "grpo", "--batch-size", "8", "--precision", "fp32"]


def grpo(ranks: int, output, *options: str, ok: bool = True) -> subprocess.CompletedProcess:
    interpreter = ("FUSETUNE_INTERPRET", "TRITON_INTERPRET")
    env = {k: v for k, v in os.environ.items() if k not in interpreter}
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    done = subprocess.run(
        [*launcher, *COMMAND, "--output", str(output), *options],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert (done.returncode == 0) == ok, done.stderr[-3000:]
    return done


def record(output) -> dict:
    return json.loads((output / "fusetune_finetune.json").read_text())["runs"][0]


def test_two_ranks_first_reward_equals_one_process(tmp_path):
    options = ("--steps", "1", "--temperature", "1e-4")
    grpo(1, tmp_path / "one", *options)
    grpo(2, tmp_path / "two", *options)
    one, two = record(tmp_path / "one"), record(tmp_path / "two")
    assert two["rewards"] == pytest.approx(one["rewards"], abs=1e-6), (one, two)
    assert two["tokens"] == one["tokens"]  # the same global prompts and completion lengths


@pytest.mark.skipif(torch.cuda.is_available(), reason="accelerate shards on GPUs: the test below")
def test_fsdp_on_cpu_ranks_says_why(tmp_path):
    done = grpo(2, tmp_path / "out", "--steps", "1", "--fsdp", ok=False)
    assert "--fsdp: accelerate" in done.stderr and "MULTI_CPU" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="accelerate's FSDP2 runs on GPUs only")
def test_fsdp_two_gpus_first_reward_equals_one_process(tmp_path):
    from safetensors.torch import load_file

    options = ("--steps", "1", "--temperature", "1e-4")
    grpo(1, tmp_path / "one", *options)
    done = grpo(2, tmp_path / "two", *options, "--fsdp")
    assert done.stderr.count("2 ranks (FSDP2)") == 1 and done.stdout.count("saved: ") == 1
    one, two = record(tmp_path / "one"), record(tmp_path / "two")
    assert two["sharded_parameters"] > 0, two  # FSDP2's DTensors, not replicas
    assert two["fused_head_calls"] == 1, two  # TRL's head through fusetune on the step
    assert two["rewards"] == pytest.approx(one["rewards"], abs=1e-6), (one, two)
    assert two["tokens"] == one["tokens"]
    adapters = [
        load_file(str(tmp_path / run / "adapter_model.safetensors")) for run in ("one", "two")
    ]
    assert {k: v.shape for k, v in adapters[1].items()} == {
        k: v.shape for k, v in adapters[0].items()
    }  # consolidated: every LoRA matrix whole, as one process saves it


def test_fsdp_on_one_process_is_a_usage_error(capsys, monkeypatch):
    from fusetune.grpo import command

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert command.main(["--fsdp"]) == 2
    assert "argument --fsdp: shards over ranks" in capsys.readouterr().err


# ----------------------------------------------------------------------------- DeepSpeed ZeRO-3

METRICS = ("rewards", "kl", "losses", "entropy", "grad_norms")


def records(output) -> list[dict]:
    return json.loads((output / "fusetune_finetune.json").read_text())["runs"]


def zero3_and_ddp(tmp_path, *options: str, check_ddp=None) -> tuple[list[dict], dict]:
    """fusetune's DDP run (``check_ddp(done)`` then looks at it) and the ZeRO-3 runs (TRL's
    own, then fusetune's: --compare)."""
    ddp = grpo(2, tmp_path / "ddp", *options)
    if check_ddp is not None:
        check_ddp(ddp)
    pytest.importorskip("deepspeed")  # not a dependency: carried to the GPU machine
    done = grpo(2, tmp_path / "zero3", *options, "--zero3", "--compare")
    assert done.stderr.count("2 ranks (DeepSpeed ZeRO-3)") == 1, done.stderr[-2000:]
    assert done.stdout.count("saved: ") == 1, done.stdout  # rank 0's
    return records(tmp_path / "zero3"), record(tmp_path / "ddp")


def check_against_ddp(runs: list[dict], ddp: dict, head_calls: int) -> None:
    trl_run, fused = runs
    assert trl_run["fused_head_calls"] == 0 and fused["fused_head_calls"] == head_calls, runs
    assert fused["partitioned_parameters"] > 0 and ddp["partitioned_parameters"] == 0
    for run in runs:  # unpatched TRL and fusetune under ZeRO-3 against fusetune under DDP
        for metric in METRICS:
            assert run[metric] == pytest.approx(ddp[metric], abs=1e-5), (run["label"], metric)
        assert run["tokens"] == ddp["tokens"]
    assert all(norm > 0 for norm in fused["grad_norms"]), fused  # the steps trained


def assert_weights_close(got: dict, want: dict) -> None:
    """Saved weights after 2 AdamW steps. Adam divides each gradient by its own size, so the
    engines' rounding (their reductions sum in other orders) moves the parameter of a near-zero
    gradient by the learning rate (2e-2 LoRA, 3e-3 full) times that gradient's relative
    difference: up to 5.5e-5 measured on CPU ranks, then 5.4e-4 (one embedding entry of 20480,
    full fine-tuning) on another CPU host (2026-12-02), hence 2e-3. A wrong gather (a shard in
    the wrong place, a zero or stale partition) is off by the weights' own size, about 0.1."""
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    for name, tensor in want.items():
        gap = (got[name] - tensor).abs().max().item()
        assert gap <= 2e-3, (name, gap)


def test_zero3_full_equals_ddp_and_saves_the_whole_model(tmp_path):
    """Full fine-tuning: ZeRO-3 partitions the head's own weight (trained), which fusetune's
    head reads inside the head's call; the saved model is gathered whole and loads."""
    import transformers

    runs, ddp = zero3_and_ddp(tmp_path, "--steps", "2", "--full")
    check_against_ddp(runs, ddp, head_calls=2)  # a call a step
    assert runs[1]["partitioned_parameters"] == 21  # every parameter of the tiny Llama
    models = [
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / run))
        for run in ("zero3", "ddp")
    ]
    assert_weights_close(*(dict(m.named_parameters()) for m in models))


def test_two_ranks_train_and_rank0_saves(tmp_path):
    """DDP (the LoRA tiny Gemma with a KL term): both ranks train, rank 0 alone prints and
    writes the output, TRL's head runs through fusetune on every call (the policy's and the
    reference's), every rank holds a full replica. The same launch is then the reference of
    the ZeRO-3 runs (one torchrun fewer: each costs ~17 s of imports on CI's CPU): LoRA on a
    model whose head is its embedding (tiny Gemma; Llama-3.2-1B's and Qwen2.5-0.5B's layout),
    with a KL term: the policy and the reference (adapters off) each call TRL's head a step on
    the partitioned embedding; the adapter is gathered whole."""
    from safetensors.torch import load_file

    options = ("--model", "tiny-gemma", "--steps", "2", "--beta", "0.04")
    runs, ddp = zero3_and_ddp(
        tmp_path, *options, check_ddp=lambda done: check_ddp_run(done, tmp_path / "ddp")
    )
    check_against_ddp(runs, ddp, head_calls=4)
    assert all(kl > 0 for kl in runs[1]["kl"][1:]), runs[1]["kl"]  # the reference is read
    adapters = [
        load_file(str(tmp_path / run / "adapter_model.safetensors")) for run in ("zero3", "ddp")
    ]
    assert_weights_close(*adapters)
    check_adapter_loads(tmp_path / "zero3", "tiny-gemma", adapters[0])


def check_ddp_run(done: subprocess.CompletedProcess, output) -> None:
    assert done.stdout.count("TRL + fusetune + PEFT: mean reward") == 1, done.stdout  # rank 0
    assert done.stdout.count("saved: ") == 1
    assert done.stderr.count("2 ranks") == 1  # the header, once
    assert done.stderr.count("TRL + fusetune + PEFT 2/2 reward") == 1  # progress: rank 0's
    files = {p.name for p in output.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= files
    run = record(output)
    assert len(run["rewards"]) == 2 and all(map(math.isfinite, run["rewards"])), run
    assert run["fused_head_calls"] == 4, run  # TRL's head through fusetune: policy, reference
    assert run["sharded_parameters"] == 0, run  # DDP: every rank a full replica


def check_adapter_loads(folder, model: str, saved: dict) -> None:
    """PEFT loads the adapter onto the base model: every saved matrix in its LoRA layer."""
    import peft

    from fusetune.finetune import models

    base = models.build(models.resolve(model), torch.float32, torch.device("cpu"), seed=0)
    loaded = dict(peft.PeftModel.from_pretrained(base, str(folder)).named_parameters())
    for name, tensor in saved.items():
        loaded_name = name.removesuffix(".weight") + ".default.weight"
        assert torch.equal(loaded[loaded_name], tensor), name


def test_zero3_on_one_process_is_a_usage_error(capsys, monkeypatch):
    from fusetune.grpo import command

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert command.main(["--zero3"]) == 2
    assert "argument --zero3: partitions over ranks" in capsys.readouterr().err


def test_zero3_with_fsdp_is_a_usage_error(capsys):
    from fusetune.grpo import command

    assert command.main(["--fsdp", "--zero3"]) == 2
    assert "argument --zero3: not allowed with argument --fsdp" in capsys.readouterr().err


def test_zero3_without_deepspeed_says_so(capsys, monkeypatch):
    from fusetune.grpo import command, zero3

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(zero3, "available", lambda: False)
    assert command.main(["--zero3"]) == 2
    assert "argument --zero3: needs DeepSpeed" in capsys.readouterr().err


def test_zero3_bf16_on_cpu_ranks_says_why(capsys, monkeypatch, tmp_path):
    from fusetune.grpo import command, zero3

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(zero3, "available", lambda: True)
    assert command.main(["--zero3", "--precision", "bf16", "--device", "cpu"]) == 2
    assert "--zero3 on the CPU trains in fp32" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written
