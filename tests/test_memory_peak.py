"""fusetune.bench.memory_peak: the allocator history replayed to the peak, blocks summed by the
frame that says why they exist. The replay on a made-up trace (CPU); a real step on the GPU.
Well under a second of CPU."""

from __future__ import annotations

import pytest
import torch

from fusetune.bench import memory_peak


def frame(filename: str, line: int = 1, name: str = "f") -> dict:
    return {"filename": filename, "line": line, "name": name}


def event(action: str, addr: int, size: int, *frames: dict) -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def test_replay_finds_the_peak_and_what_lived_then():
    model = frame("/x/site-packages/transformers/models/llama/modeling_llama.py", 7, "forward")
    trace = [
        event("alloc", 1, 100, frame("/x/torch/nn/functional.py"), model),
        event("free_completed", 9, 40),  # a block from before the recording
        event("alloc", 2, 300, frame("/x/fusetune/ops/rms_norm.py", 3, "rms_norm")),
        event("free_completed", 2, 300),
        event("alloc", 3, 50, frame("/x/torch/distributed/fsdp/_fully_shard/x.py", 5, "ag")),
        event("free_completed", 1, 100),
    ]
    index, above, live, freed_before = memory_peak._replay(trace, None)
    assert (index, above) == (2, 360)  # 100 - 40 + 300
    _, above, live, freed_before = memory_peak._replay(trace, index)
    assert sorted(live) == [1, 2] and freed_before == 40
    sites = {memory_peak._site(frames) for _, frames in live.values()}
    assert sites == {"transformers/models/llama/modeling_llama.py:7 forward",
                     "fusetune/ops/rms_norm.py:3 rms_norm"}  # fmt: skip
    harness = frame("/x/fusetune/bench/distributed_worker.py", 9, "step")
    assert memory_peak._site([frame("/home/me/train.py", 4, "main"), harness]) == "train.py:4 main"
    inner = frame("/opt/torch/.venv/lib/site-packages/torch/distributed/fsdp/_fsdp_param.py", 2,
                  "alloc_storage")  # fmt: skip
    assert memory_peak._site([inner, harness, model]) == (
        "torch/distributed/fsdp/_fsdp_param.py:2 alloc_storage"
    )
    assert memory_peak._site([]) == "(no Python frame)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU pass only (the CUDA allocator)")
def test_live_at_peak_names_this_file():
    device = torch.device("cuda")
    kept = torch.randn(4096, 4096, device=device)  # before the step: 64 MiB

    def step():
        big = torch.randn(2048, 2048, device=device)  # 16 MiB, live at the peak
        small = big[:8].clone()
        del big, small

    lines = memory_peak.live_at_peak(step, device)
    before = torch.cuda.memory_allocated(device) / 2**30  # the 64 MiB and what else lives
    assert f"before the step {before:.2f} GiB" in lines[0] and before >= 0.06, lines
    assert "test_memory_peak.py" in lines[1] and "0.016 GiB" in lines[1], lines
    del kept
