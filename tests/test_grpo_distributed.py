"""``python -m fusetune grpo`` under ``torchrun --nproc-per-node 2``: TRL's GRPOTrainer runs on
both ranks through accelerate (DDP; gloo on the CPU, NCCL on 2 GPUs), each rank on its share of
every step's prompts (TRL's sampler: the same seeded global order, one slice a rank); rank 0
prints and writes the output; ``--batch-size`` stays the global batch.

A sampled step cannot equal a one-process step: each rank draws its completions from its own
generator, seeded as the single process is but drawing for fewer rows, so the completions (and
the rewards, advantages and loss) differ. Near-greedy sampling (temperature 1e-4) removes the
draw: the first step's reward, over the same global prompts, then equals the single process's.
Subprocesses without the interpreter switch, as a user runs them (CPU: the reference path)."""

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


def grpo(ranks: int, output, *options: str) -> subprocess.CompletedProcess:
    interpreter = ("FUSETUNE_INTERPRET", "TRITON_INTERPRET")
    env = {k: v for k, v in os.environ.items() if k not in interpreter}
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    done = subprocess.run(
        [*launcher, *COMMAND, "--output", str(output), *options],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def record(output) -> dict:
    return json.loads((output / "fusetune_finetune.json").read_text())["runs"][0]


def test_two_ranks_train_and_rank0_saves(tmp_path):
    output = tmp_path / "out"
    done = grpo(2, output, "--steps", "2")
    assert done.stdout.count("TRL + fusetune + PEFT: mean reward") == 1, done.stdout  # rank 0
    assert done.stdout.count("saved: ") == 1
    assert done.stderr.count("2 ranks") == 1  # the header, once
    assert done.stderr.count("TRL + fusetune + PEFT 2/2 reward") == 1  # progress: rank 0's
    files = {p.name for p in output.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= files
    run = record(output)
    assert len(run["rewards"]) == 2 and all(map(math.isfinite, run["rewards"])), run
    assert run["fused_head_calls"] == 2, run  # TRL's head through fusetune on every step


def test_two_ranks_first_reward_equals_one_process(tmp_path):
    options = ("--steps", "1", "--temperature", "1e-4")
    grpo(1, tmp_path / "one", *options)
    grpo(2, tmp_path / "two", *options)
    one, two = record(tmp_path / "one"), record(tmp_path / "two")
    assert two["rewards"] == pytest.approx(one["rewards"], abs=1e-6), (one, two)
    assert two["tokens"] == one["tokens"]  # the same global prompts and completion lengths
