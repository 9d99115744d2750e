"""``python -m fusetune grpo``: the default run learns (its mean reward rises) and writes its
output all at once; bad input exits 2 with one message and writes nothing. The default run is a
subprocess without the interpreter switch, as a user runs it (on the CPU: fusetune's reference
path; on a GPU: the kernels)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from fusetune.grpo import main, rewards

pytest.importorskip("trl")
pytest.importorskip("datasets")


def test_default_run_learns_and_saves(tmp_path):
    output = tmp_path / "out"
    env = {
        k: v for k, v in os.environ.items() if k not in ("FUSETUNE_INTERPRET", "TRITON_INTERPRET")
    }
    done = subprocess.run(
        [sys.executable, "-m", "fusetune", "grpo", "--steps", "20", "--output", str(output)],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = re.search(
        r"TRL \+ fusetune \+ PEFT: mean reward ([\d.]+) .* -> ([\d.]+)", done.stdout
    )
    assert summary, done.stdout
    first, last = map(float, summary.groups())
    assert last > first + 0.2, done.stdout
    assert "reward" in done.stderr and "tok/s" in done.stderr  # the progress line
    files = {p.name for p in output.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= files
    record = json.loads((output / "fusetune_finetune.json").read_text())
    assert record["command"] == "grpo" and len(record["runs"][0]["rewards"]) == 20


def _grpo(*argv: str) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("FUSETUNE_INTERPRET", "TRITON_INTERPRET")
    }
    command = [sys.executable, "-m", "fusetune", "grpo", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def test_resume_continues_to_the_same_adapter(tmp_path, capsys):
    """TRL's checkpoints every --save-every steps in OUTPUT/checkpoint-<step>; a run stopped at
    step 2 and resumed to step 4 ends with the uninterrupted run's adapter, byte for byte. The
    refusals exit before any model is built: they run in this process (a subprocess costs
    ~8 s of imports on CI's CPU)."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert _grpo("--steps", "4", "--save-every", "2", "--output", str(whole)).returncode == 0
    assert _grpo("--steps", "2", "--save-every", "2", "--output", str(resumed)).returncode == 0
    capsys.readouterr()
    assert main(["--steps", "2", "--save-every", "2", "--output", str(resumed)]) == 2
    assert "holds an earlier run's checkpoints" in capsys.readouterr().err
    done = _grpo("--steps", "4", "--save-every", "2", "--output", str(resumed), "--resume")
    assert done.returncode == 0, done.stderr[-2000:]
    assert {p.name for p in resumed.iterdir()} >= {"checkpoint-2", "checkpoint-4"}
    adapter = "adapter_model.safetensors"
    assert (resumed / adapter).read_bytes() == (whole / adapter).read_bytes()
    assert main(["--output", str(tmp_path / "new"), "--resume", str(tmp_path)]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_rewards():
    assert rewards.exact_answer(["1+1="], ["2 apples", "x"], answer=["2", "2"])[0] == 1.0
    assert rewards.exact_answer(["1+1="], ["-3"], answer=["3"]) == [0.0]
    assert rewards.digits([""], ["12ab", ""]) == [0.5, 0.0]
    assert rewards.resolve("os.path:join") is os.path.join


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--data", "missing.jsonl"], "no such file"),
        (["--data", "{bad}"], "line 1: not JSON"),
        (["--data", "{no_prompt}"], "needs a string 'prompt'"),
        (["--reward", "nope"], "not a built-in reward"),
        (["--reward", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
        (["--reward", "os.path:nothing_here"], "has no function 'nothing_here'"),
        (["--batch-size", "6", "--num-generations", "4"], "not a multiple of --num-generations"),
        (["--loss-type", "ppo"], "invalid choice"),
        (["--model", "./no/such/folder"], "no such model folder"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(argv, message, tmp_path, capsys):
    data_files = {"{bad}": "{not json\n", "{no_prompt}": '{"answer": "1"}\n'}
    if argv[:1] == ["--data"] and argv[1] in data_files:
        path = tmp_path / "data.jsonl"
        path.write_text(data_files[argv[1]])
        argv = ["--data", str(path)]
    output = tmp_path / "out"
    assert main([*argv, "--output", str(output)]) == 2
    assert message in capsys.readouterr().err
    assert not output.exists()


def test_one_process_sees_one_gpu(monkeypatch):
    """Without torchrun the command shows the process only the GPU --device names (TRL's
    GRPOTrainer refuses the nn.DataParallel transformers picks for a process seeing several);
    torchrun, a CUDA_VISIBLE_DEVICES already set and the CPU are left alone."""
    from fusetune.grpo import command

    monkeypatch.setattr(command.torch.cuda, "is_initialized", lambda: False)
    for name in ("WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):  # set first: undone to the original
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert command.one_visible_gpu("cuda:1") == "cuda"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert command.one_visible_gpu("auto") == "auto"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert command.one_visible_gpu("cuda:2") == "cuda:2"  # already set: left alone
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    for left_alone in ("cpu", "cuda:x"):
        assert command.one_visible_gpu(left_alone) == left_alone
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert command.one_visible_gpu("cuda") == "cuda"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_checkpoint_wrapped_peft_model_saves_the_whole_adapter(tmp_path):
    """--fsdp checkpoints activations with torch's checkpoint_wrapper: module paths then hold
    `_checkpoint_wrapped_module.` and state_dict keys do not, and PEFT saved an empty adapter
    from the gathered state (2x H100, peft 0.21.0). The save keeps every matrix, named as an
    unwrapped model's."""
    import peft
    import torch
    import transformers
    from safetensors.torch import load_file
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as wrapper

    from fusetune.grpo.command import save_pretrained

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)
    model.save_pretrained(str(tmp_path / "plain"))
    wrapper.apply_activation_checkpointing(
        model, check_fn=lambda m: type(m).__name__ == "LlamaDecoderLayer"
    )
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    save_pretrained(
        model, tmp_path / "wrapped", {k: v.clone() for k, v in model.state_dict().items()}
    )
    want = load_file(str(tmp_path / "plain" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "wrapped" / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and len(want) == 8
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
