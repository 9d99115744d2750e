"""``python -m fusetune finetune`` on 2 ranks (as torchrun starts it: the environment names the
rank and world) against 1 process on the same global batches: the same per-step losses in fp32,
rank 0 alone writes the output, and the saved adapter is the same. Gloo on the CPU; on a machine
with 2 GPUs, NCCL."""

from __future__ import annotations

import importlib.util
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
ARGV = ["--steps", "2", "--seq-len", "24", "--precision", "fp32", "--grad-accum", "2"]


def rank_main(rank: int, ports: list[int], outputs: list[str], layouts: list[list[str]]) -> None:
    """Each layout's 2-rank run in turn, in this one process (a spawn costs each rank ~13 s of
    imports on CI's CPU): finetune joins the group, and leaves it at the end of its run."""
    device = "cuda" if torch.cuda.device_count() >= WORLD else "cpu"
    for port, output, layout in zip(ports, outputs, layouts, strict=True):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        code = main([*ARGV, *layout, "--batch-size", "1", "--device", device, "--output", output])
        assert code == 0, layout


TWO_RANKS = pytest.mark.skipif(
    torch.cuda.device_count() == 1,
    reason="2 ranks need 2 GPUs (NCCL) or none (gloo on the CPU): see test_distributed.py",
)
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="GPU pass (2 GPUs)")
BNB = importlib.util.find_spec("bitsandbytes") is not None  # --load-in-4bit needs it
FSDP2 = ([], "2 ranks (FSDP2, adapters replicated)")
# QLoRA data parallel: the 4-bit base quantised alike on every rank (on the CPU --load-in-4bit,
# which implies --replicate, covers the replicated layout)
LOAD_IN_4BIT = (["--load-in-4bit"], "2 ranks (replicated)")


@pytest.mark.parametrize(
    "layouts",
    [
        # FSDP2 and QLoRA from one spawn
        pytest.param(
            [FSDP2, LOAD_IN_4BIT] if BNB else [FSDP2], marks=TWO_RANKS, id="fsdp2+load-in-4bit"
        ),  # fmt: skip
        pytest.param([(["--replicate"], "2 ranks (replicated)")], marks=TWO_GPUS, id="replicate"),
        # 2 eager steps, the capture, 2 replays; the adapters' gradients averaged in the graph
        pytest.param(
            [(["--cuda-graph", "--steps", "5"], "CUDA graphs on 2 ranks (replicated)")],
            marks=TWO_GPUS,
            id="cuda-graph",
        ),  # fmt: skip
    ],
)
def test_two_ranks_match_one_process(tmp_path, layouts):
    """FSDP2 (the base sharded, shard_lora), the model replicated (QLoRA's 4-bit base on the
    CPU), and the replicated model's step replayed from CUDA graphs: each against one process
    with the same options. The layouts of one case run in one spawn, one after the other;
    each is checked, the failures reported together."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ones = [tmp_path / f"one-{index}" for index in range(len(layouts))]
    twos = [tmp_path / f"two-{index}" for index in range(len(layouts))]
    for one, (layout, _) in zip(ones, layouts, strict=True):
        argv = [*ARGV, *layout, "--batch-size", str(WORLD), "--device", device,
                "--output", str(one)]  # fmt: skip
        assert main(argv) == 0, layout
    options = [layout for layout, _ in layouts]
    ports = [free_port() for _ in layouts]
    mp.spawn(rank_main, args=(ports, [str(t) for t in twos], options), nprocs=WORLD, join=True)
    failures = []
    for one, two, (layout, label) in zip(ones, twos, layouts, strict=True):
        try:
            check_layout(one, two, layout, label)
        except AssertionError as error:
            failures.append(f"{layout or 'FSDP2'}: {error}")
    assert not failures, "\n".join(failures)
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


def check_layout(one, two, layout: list[str], label: str) -> None:
    """The 2-rank run's output (``two``) against one process's (``one``): label, per-step
    losses in fp32, the saved adapter."""
    from safetensors.torch import load_file

    want = json.loads((one / MARKER).read_text())["runs"][0]
    got = json.loads((two / MARKER).read_text())["runs"][0]
    assert label in got["label"]
    assert len(got["losses"]) == len(want["losses"]) == (5 if "--cuda-graph" in layout else 2)
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
    got_adapter = load_file(str(two / "adapter_model.safetensors"))
    want_adapter = load_file(str(one / "adapter_model.safetensors"))
    assert got_adapter.keys() == want_adapter.keys() and want_adapter
    # finetune's AdamW has eps 1e-8: an element whose gradient is ~0 moves by ~lr whatever its
    # sign, so a 1e-7 difference in a gradient (the sum over ranks in another order) can move
    # one element by 1e-6 (measured); the updates of test_transformers use the same 1e-3
    for name, tensor in want_adapter.items():
        assert_close(f"adapter {name}", got_adapter[name], tensor, 1e-3)


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


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cuda-graph", "--full"], "--cuda-graph under torchrun: LoRA only"),
        (["--replicate", "--full"], "argument --replicate: LoRA only"),
    ],
    ids=["cuda-graph-full", "replicate-full"],
)
def test_replicated_layouts_are_lora_only(argv, message, tmp_path, capsys, monkeypatch):
    """Full fine-tuning keeps FSDP2 under torchrun: a replicated or graphed full run is refused
    with the reason, before anything is written."""
    from fusetune.finetune import command, distributed

    monkeypatch.setattr(
        command.distributed, "setup", lambda device: (distributed.Ranks(0, 2), device)
    )
    assert main([*argv, "--output", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
