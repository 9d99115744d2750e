"""FSDP2 + torch.compile: fusetune.compile_layers on a PEFT LoRA Llama that FSDP2 shards over 2
ranks (finetune's sharding: each decoder layer, then the root), as ``finetune --compile`` runs
under torchrun. FSDP2's hooks split the compiled stack at every layer; fusetune's layers then
share their graphs as plain PEFT's do (when each layer had its own forward objects, each
compiled its own graph, and past 8 layers Dynamo's recompile limit left the rest eager), and
train as the eager model does. NCCL and Inductor on 2 GPUs (the GPU pass: tools/gpu_distributed.sh
tests); the same code runs with gloo and aot_eager on CPU ranks, too slow for CI."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

import fusetune
from fusetune.finetune import distributed, main
from fusetune.finetune.output import MARKER
from harness import assert_close, free_port, graphs_compiled
from test_compile_layers import BACKEND, TOL, batches, lora_model, train

pytest.importorskip("peft")
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning"),
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason="GPU pass (2 GPUs, NCCL, Inductor): 150 s of CPU with gloo and aot_eager; on the "
        "CPU tests/test_compile_layers.py checks the layers' shared graphs in one process",
    ),
]
WORLD, LAYERS, STEPS = 2, 6, 2
NCCL = torch.cuda.device_count() >= WORLD


def join(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    if NCCL:
        torch.cuda.set_device(rank)  # lora_model and batches put tensors on "cuda": this one


def sharded_runs(rank: int, port: int, results: str) -> None:
    """Plain PEFT and fusetune, each compiled and sharded: (losses, adapters, graphs compiled
    after each step) on rank 0. Every rank trains on the whole batch, so the gradients FSDP2
    averages are one process's."""
    join(rank, port)
    dist.init_process_group("nccl" if NCCL else "gloo")
    runs = {}
    for fused in (False, True):  # plain PEFT first: a live patched model fuses the family's rope
        torch._dynamo.reset()
        model = lora_model("llama", fused=fused, layers=LAYERS)
        model.get_base_model().config.use_cache = False  # as finetune trains
        fusetune.compile_layers(model, backend=BACKEND)
        distributed.shard(model)
        before = graphs_compiled()
        losses, params, graphs, _ = train(model, batches(STEPS))
        params = {name: whole(param).cpu() for name, param in params.items()}
        runs[fused] = (losses, params, [count - before for count in graphs])
    if rank == 0:
        torch.save(runs, results)
    dist.destroy_process_group()


def whole(param: torch.Tensor) -> torch.Tensor:
    """A sharded parameter gathered; a replicated one (shard_lora's adapters) as it is."""
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def test_compiled_sharded_layers_share_graphs_and_train_as_eager(tmp_path):
    """No more graphs than plain PEFT's under the same compile and sharding, none after the
    first step, fewer than one per layer; fusetune's losses and adapters are the eager
    patched model's on one process."""
    results = tmp_path / "runs.pt"
    mp.spawn(sharded_runs, args=(free_port(), str(results)), nprocs=WORLD, join=True)
    runs = torch.load(results)
    plain, fused = runs[False][2], runs[True][2]
    assert plain[0] == plain[-1] < LAYERS, runs  # PEFT's layers share graphs
    assert fused[0] == fused[-1] <= plain[0], (plain, fused)
    eager = lora_model("llama", layers=LAYERS)
    eager.get_base_model().config.use_cache = False
    want_losses, want_params, _, _ = train(eager, batches(STEPS))
    got_losses, got_params, _ = runs[True]
    assert_close("per-step losses", got_losses, want_losses, TOL)
    assert got_params.keys() == want_params.keys() and want_params
    for name, param in want_params.items():
        assert_close(name, got_params[name], param.cpu(), TOL)
    fusetune.revert(eager)


# ----------------------------------------------------------------------------- finetune --compile

COMPILE = "default" if NCCL else "aot_eager"
ARGV = ["--steps", "3", "--seq-len", "24", "--precision", "fp32", "--compile", COMPILE]


def finetune_rank(rank: int, port: int, output: str) -> None:
    join(rank, port)
    device = "cuda" if NCCL else "cpu"
    assert main([*ARGV, "--batch-size", "1", "--device", device, "--output", output]) == 0


def test_finetune_compile_under_torchrun_matches_one_process(tmp_path):
    """``finetune --compile`` on 2 ranks: the one-process compiled run's losses, the steps
    after the first compile nothing (all but the first counted in tokens/s)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    one = tmp_path / "one"
    assert main([*ARGV, "--batch-size", str(WORLD), "--device", device, "--output", str(one)]) == 0
    two = tmp_path / "two"
    mp.spawn(finetune_rank, args=(free_port(), str(two)), nprocs=WORLD, join=True)
    want = json.loads((one / MARKER).read_text())["runs"][0]
    got = json.loads((two / MARKER).read_text())["runs"][0]
    assert "2 ranks" in got["label"] and "compile" in got["label"], got["label"]
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
    assert got["untimed_steps"] == 1 and got["tokens_per_s"] > 0, got
