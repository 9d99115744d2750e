"""``python -m fusetune finetune`` on 2 ranks (as torchrun starts it: the environment names the
rank and world) against 1 process on the same global batches: the same per-step losses in fp32,
rank 0 alone writes the output, and the saved adapter is the same. Gloo on the CPU; on a machine
with 2 GPUs, NCCL."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from fusetune.finetune import main
from fusetune.finetune.output import MARKER
from harness import assert_close, free_port

pytest.importorskip("peft")
WORLD = 2
ARGV = ["--steps", "2", "--seq-len", "32", "--precision", "fp32", "--grad-accum", "2"]


def rank_main(rank: int, port: int, output: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    device = "cuda" if torch.cuda.device_count() >= WORLD else "cpu"
    code = main([*ARGV, "--batch-size", "1", "--device", device, "--output", output])
    assert code == 0


@pytest.mark.skipif(
    torch.cuda.device_count() == 1,
    reason="2 ranks need 2 GPUs (NCCL) or none (gloo on the CPU): see test_distributed.py",
)
def test_two_ranks_match_one_process(tmp_path):
    one = tmp_path / "one"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert main([*ARGV, "--batch-size", str(WORLD), "--device", device, "--output", str(one)]) == 0
    two = tmp_path / "two"
    mp.spawn(rank_main, args=(free_port(), str(two)), nprocs=WORLD, join=True)
    want = json.loads((one / MARKER).read_text())["runs"][0]
    got = json.loads((two / MARKER).read_text())["runs"][0]
    assert "2 ranks (FSDP2, adapters replicated)" in got["label"]  # shard_lora
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
    from safetensors.torch import load_file

    got_adapter = load_file(str(two / "adapter_model.safetensors"))
    want_adapter = load_file(str(one / "adapter_model.safetensors"))
    assert got_adapter.keys() == want_adapter.keys() and want_adapter
    # finetune's AdamW has eps 1e-8: an element whose gradient is ~0 moves by ~lr whatever its
    # sign, so a 1e-7 difference in a gradient (the sum over ranks in another order) can move
    # one element by 1e-6 (measured); the updates of test_transformers use the same 1e-3
    for name, tensor in want_adapter.items():
        assert_close(f"adapter {name}", got_adapter[name], tensor, 1e-3)
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


@pytest.mark.parametrize("variable", ["ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"])
def test_accelerate_engine_plugins_are_refused(variable, tmp_path, capsys, monkeypatch):
    """accelerate launch with a DeepSpeed or FSDP config: finetune shards with FSDP2 itself, so
    it says the engine would be ignored and stops before writing anything."""
    from fusetune.finetune import command, distributed

    monkeypatch.setenv(variable, "true")
    monkeypatch.setattr(
        command.distributed, "setup", lambda device: (distributed.Ranks(0, 2), device)
    )
    assert main(["--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert variable in err and "FSDP2" in err
    assert not (tmp_path / "o").exists()
