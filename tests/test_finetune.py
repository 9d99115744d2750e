"""``python -m fusetune finetune`` end to end on the built-in tiny model, its bad-input errors,
and its parts (data parsing, tokenisation masks, batches, precision choice, summary); plus the
``bench e2e`` smoke run.

Under the Triton interpreter (CPU) a training step of the tiny model takes seconds, so runs are
a few steps of 2 x 24 tokens."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusetune.finetune import FinetuneError, distributed, main
from fusetune.finetune import data as ftdata
from fusetune.finetune import train as train_module
from fusetune.finetune.output import MARKER, check_output, staged_output
from fusetune.finetune.precision import bf16_supported, choose_precision
from fusetune.finetune.summary import format_comparison, loss_rows
from fusetune.finetune.tokenizers import ByteTokenizer, HFTokenizer
from fusetune.finetune.train import RunResult

peft = pytest.importorskip("peft")
# PEFT reads a transformers property that 5.2x deprecates (PeftModel.from_pretrained below).
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
transformers = pytest.importorskip("transformers")

TINY_RUN = ["--steps", "2", "--batch-size", "2", "--seq-len", "24"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*TINY_RUN, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def leftovers(folder: Path) -> list[str]:
    """Staging folders a failed run would have left behind."""
    return [p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def short_data(folder: Path) -> Path:
    """Examples that fit in a dozen bytes, completions of different lengths."""
    pairs = [("1+1=", "2"), ("9+9=", "18"), ("a:", "bcdef"), ("x", "yz"), ("pq", "rstu")]
    lines = [json.dumps({"prompt": p, "completion": c}) for p, c in pairs]
    return write_jsonl(folder / "short.jsonl", lines)


# ----------------------------------------------------------------------------- end to end


PINNABLE = hasattr(os, "sched_setaffinity")


def test_lora_run_saves_adapter_then_compare_replaces_it(tmp_path, capsys, monkeypatch):
    """The first run also pins (--pin-cpu, where Linux pins): one pin, after the first step (its
    compiles and threads keep the whole mask), and the process's mask back as it was after the
    run (a run of its own cost 27 s of CI's CPU)."""
    steps, pins = [], []  # pins: how many steps had run at each pin

    def step(*args):
        steps.append(1)
        return real_step(*args)

    def pin(ranks):
        pins.append(len(steps))
        return real_pin(ranks)

    real_step, real_pin = train_module._step, train_module.pin_main_thread
    monkeypatch.setattr(train_module, "_step", step)
    monkeypatch.setattr(train_module, "pin_main_thread", pin)
    before = os.sched_getaffinity(0) if PINNABLE else None
    output = tmp_path / "run"
    code, out, err = run(capsys, "--output", str(output), *(["--pin-cpu"] if PINNABLE else []))
    assert code == 0, err
    assert len(steps) == 2
    if PINNABLE:
        assert pins == [1]
        assert os.sched_getaffinity(0) == before
    assert "fusetune finetune: done" in out and "tokens/s" in out and "peak memory" in out
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = choose_precision("auto", device.type, bf16_supported(device))
    assert "precision" in out and precision.describe() in out  # CPU: "fp32: running on the CPU"
    assert "HF + PEFT + fusetune 2/2" in err and "loss" in err and "tok/s" in err
    files = {p.name for p in output.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", MARKER} <= files
    record = json.loads((output / MARKER).read_text())
    assert record["mode"] == "lora" and len(record["runs"][0]["losses"]) == 2

    # The adapter loads back into a fresh (unpatched) tiny model.
    from fusetune.finetune import models

    spec = models.resolve("tiny-llama")
    base = models.build(spec, torch.float32, torch.device("cpu"), seed=0)
    loaded = peft.PeftModel.from_pretrained(base, str(output))
    lora_b = [p for n, p in loaded.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 2 * 7 and any(p.abs().sum() > 0 for p in lora_b)

    # --compare into the same folder: our own previous output is replaced, all at once.
    code, out, err = run(capsys, "--output", str(output), "--compare")
    assert code == 0, err
    assert "HF + PEFT 2/2" in err
    table = out[out.index("same 2 steps") :]
    assert "HF + PEFT + fusetune" in table and "tokens/s" in table and "peak memory" in table
    runs = json.loads((output / MARKER).read_text())["runs"]
    assert [r["label"] for r in runs] == ["HF + PEFT", "HF + PEFT + fusetune"]
    # fp32 on the CPU: the same losses; bf16 autocast on a GPU: within bf16's rounding
    close = 1e-4 if precision.name == "fp32" else 1e-2
    torch.testing.assert_close(runs[0]["losses"], runs[1]["losses"], rtol=close, atol=close)
    assert leftovers(tmp_path) == []


def test_gradient_accumulation_matches_one_big_batch(tmp_path, capsys):
    """4 sequences a step as 1 x 4 or 2 x 2 accumulated: the same examples, the same losses
    (HF's num_items_in_batch: a sum over tokens / the step's token count). Completions of
    different lengths, so the micro-batches weigh differently."""
    data = short_data(tmp_path)
    losses = []
    for batch, accum in ((4, 1), (2, 2)):
        output = tmp_path / f"b{batch}"
        argv = ["--batch-size", str(batch), "--grad-accum", str(accum), "--output", str(output)]
        argv += ["--precision", "fp32"]  # the accumulation arithmetic, on a GPU too
        code = main(["--steps", "2", "--seq-len", "12", "--data", str(data), *argv])
        assert code == 0, capsys.readouterr().err
        losses.append(json.loads((output / MARKER).read_text())["runs"][0]["losses"])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning is Linux's")
def test_pin_main_thread_spreads_the_ranks_of_a_host(monkeypatch):
    """Each local rank gets a core of its own from the middle of its share of the mask (never
    the first core); too few cores for the ranks: a warning, no pin."""
    pinned = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append(set(cores)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8, 16)))
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        assert distributed.pin_main_thread(distributed.Ranks(rank, 4)) == set(range(8, 16))
    assert pinned == [{9}, {11}, {13}, {15}]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    with pytest.warns(UserWarning, match="8 cores .* for 5 ranks"):
        assert distributed.pin_main_thread(distributed.Ranks(0, 5)) is None
    assert len(pinned) == 4


def test_full_finetune_with_checkpointing_saves_the_model(tmp_path, capsys):
    output = tmp_path / "full"
    argv = ["--full", "--gradient-checkpointing", "--grad-accum", "2", "--steps", "1"]
    argv += ["--data", str(short_data(tmp_path)), "--output", str(output)]
    code = main(["--batch-size", "2", "--seq-len", "12", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    files = {p.name for p in output.iterdir()}
    assert {"config.json", "model.safetensors", "byte_tokenizer.json", MARKER} <= files
    assert "full fine-tuning" in out and "gradient checkpointing" in out


# ----------------------------------------------------------------------------- bad input


GOOD_LINE = json.dumps({"prompt": "Add 2 and 3.\n", "completion": "5"})


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    malformed = write_jsonl(tmp_path / "bad.jsonl", [GOOD_LINE, "", '{"prompt": "x", }'])
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(gpt2)
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    return {
        "missing file": (["--data", str(tmp_path / "nope.jsonl")], "file not found"),
        "malformed line": (["--data", str(malformed)], "bad.jsonl:3: not valid JSON"),
        "unpatchable family": (["--model", str(gpt2)], "'gpt2' model, which fusetune cannot"),
        "no such model folder": (["--model", str(tmp_path / "m")], "no such model folder"),
        "foreign output": (["--output", str(foreign)], "a non-empty folder that fusetune did"),
        "bad number": (["--steps", "0"], "--steps: expected a positive integer, got 0"),
        "unknown option": (["--bogus"], "unrecognized arguments: --bogus"),
        "fp16 on cpu": (["--precision", "fp16", "--device", "cpu"], "fp16 needs a CUDA GPU"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing file",
        "malformed line",
        "unpatchable family",
        "no such model folder",
        "foreign output",
        "bad number",
        "unknown option",
        "fp16 on cpu",
    ],
)
def test_bad_input_exits_2_with_a_clear_message_and_writes_nothing(tmp_path, capsys, case):
    argv, message = bad_inputs(tmp_path)[case]
    before = {p.name for p in tmp_path.iterdir()}
    output = ["--output", str(tmp_path / "out")] if "--output" not in argv else []
    code = main([*argv, *output])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert {p.name for p in tmp_path.iterdir()} == before  # no output, no staging folder
    if case == "foreign output":
        assert (tmp_path / "theirs" / "notes.txt").read_text() == "keep me"
    if case == "unpatchable family":
        assert "llama" in err and "qwen2" in err  # the supported families are listed


def test_unknown_option_exit_status_from_the_real_command(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "fusetune", "finetune", "--bogus", "--output", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert "unrecognized arguments: --bogus" in done.stderr


def test_failure_while_saving_leaves_nothing(tmp_path):
    output = tmp_path / "out"
    with pytest.raises(RuntimeError), staged_output(output) as staging:
        (staging / "half.bin").write_bytes(b"x")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_check_output_rejects_a_file(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(FinetuneError, match="exists and is not a folder"):
        check_output(target)
    check_output(tmp_path / "new" / "deeper")  # a folder that does not exist yet is fine


# ----------------------------------------------------------------------------- data


def parse(*lines: str) -> list[ftdata.Example]:
    return list(ftdata.parse_lines(lines, "d.jsonl"))


def test_parse_prompt_completion_and_messages_skipping_blank_lines():
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    examples = parse(GOOD_LINE, "   ", json.dumps(chat))
    assert [e.line for e in examples] == [1, 3]
    assert examples[0].prompt == "Add 2 and 3.\n" and examples[0].completion == "5"
    assert examples[1].messages == (("user", "Hi"), ("assistant", "Yo"))


@pytest.mark.parametrize(
    "line,message",
    [
        ("[1, 2]", "d.jsonl:1: expected a JSON object, got a list"),
        ('{"prompt": "x"}', "'completion' must be a string, got missing"),
        ('{"prompt": 3, "completion": "y"}', "'prompt' must be a string, got a number"),
        ('{"prompt": "x", "completion": ""}', "'completion' is empty"),
        ('{"text": "x"}', "expected 'prompt' and 'completion' strings or a 'messages' list"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0]: 'role' must be one of"),
        ('{"messages": [{"role": "user", "content": 1}]}', "'content' must be a string"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
        ("{'single': 'quotes'}", "d.jsonl:1: not valid JSON"),
    ],
)
def test_parse_errors_name_the_line_and_the_problem(line, message):
    with pytest.raises(FinetuneError) as info:
        parse(line)
    assert message in str(info.value)


def test_non_utf8_line_is_reported_with_its_number():
    with pytest.raises(FinetuneError, match=r"d\.jsonl:2: not UTF-8"):
        list(ftdata.parse_lines([GOOD_LINE.encode(), b'{"prompt": "\xff"}'], "d.jsonl"))


def test_shipped_dataset_parses():
    examples, name = ftdata.load_examples(None)
    assert len(examples) >= 100 and "built-in" in name
    assert any(e.messages for e in examples) and any(e.prompt for e in examples)


def test_byte_tokenizer_trains_only_the_completion_and_eos():
    tok = ByteTokenizer()
    example = ftdata.Example(line=1, prompt="ab", completion="c")
    ids, labels = ftdata.encode_example(example, tok)
    assert ids == [tok.bos_id, 97, 98, 99, tok.eos_id]
    assert labels == [-100, -100, -100, 99, tok.eos_id]


def test_plain_chat_template_trains_only_assistant_turns():
    tok = ByteTokenizer()
    messages = (("user", "hi"), ("assistant", "yo"), ("user", "?"), ("assistant", "ok"))
    ids, labels = ftdata.encode_example(ftdata.Example(line=1, messages=messages), tok)
    trained = [i for i, label in zip(ids, labels, strict=True) if label != -100]
    assert tok.decode(trained) == "yook" and trained.count(tok.eos_id) == 2
    assert tok.decode(ids).startswith("<|user|>\nhi\n<|assistant|>\nyo")


class CharTokenizer:
    """Enough of a transformers tokenizer for HFTokenizer: one id per character, a chat
    template that closes each turn with '|'."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, None
    chat_template = "(python)"

    def __call__(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        return type("Encoding", (), {"input_ids": ([1] if add_special_tokens else []) + ids})

    def __len__(self):
        return 0x110000

    def apply_chat_template(self, turns, tokenize, add_generation_prompt):
        text = "".join(f"<{t['role'][0]}>{t['content']}|" for t in turns)
        return text + ("<a>" if add_generation_prompt else "")


def test_hf_chat_template_masks_all_but_the_assistant_text_and_its_end():
    tok = HFTokenizer(CharTokenizer(), "char")
    assert tok.prefix == [1] and tok.pad_id == 2  # BOS added by default; pad falls back to EOS
    messages = (("system", "s"), ("user", "u"), ("assistant", "A"))
    messages += (("user", "v"), ("assistant", "B"))
    ids, labels = ftdata.encode_example(ftdata.Example(line=1, messages=messages), tok)
    assert "".join(map(chr, ids)) == "<s>s|<u>u|<a>A|<u>v|<a>B|"
    assert "".join(chr(label) for label in labels if label != -100) == "A|B|"


def test_encode_all_truncates_and_drops_examples_without_a_trained_token():
    tok = ByteTokenizer()
    long_prompt = ftdata.Example(line=1, prompt="x" * 40, completion="y")
    fits = ftdata.Example(line=2, prompt="q", completion="abc")
    kept, dropped = ftdata.encode_all([long_prompt, fits], tok, seq_len=8)
    assert dropped == 1 and len(kept) == 1 and len(kept[0][0]) == 6
    with pytest.raises(FinetuneError, match="no example has a completion token within"):
        ftdata.encode_all([long_prompt], tok, seq_len=8)


def test_batches_pad_right_and_count_tokens_and_labels():
    tok = ByteTokenizer()
    examples = [ftdata.Example(line=i, prompt="p" * i, completion="c") for i in range(1, 4)]
    encoded, _ = ftdata.encode_all(examples, tok, seq_len=64)
    batches = ftdata.make_batches(encoded, batch_size=3, count=2, pad_id=tok.pad_id, seed=0)
    first = batches[0]
    lengths = sorted(first.attention_mask.sum(1).tolist())
    assert lengths == [4, 5, 6] and first.input_ids.shape == (3, 6)
    assert first.tokens == 15 and first.label_count == 3 * 2  # "c" + EOS per row
    assert (first.input_ids[first.attention_mask == 0] == tok.pad_id).all()
    assert (first.labels[first.attention_mask == 0] == -100).all()
    again = ftdata.make_batches(encoded, batch_size=3, count=2, pad_id=tok.pad_id, seed=0)
    assert torch.equal(again[1].input_ids, batches[1].input_ids)  # seeded


# ----------------------------------------------------------------------------- precision


@pytest.mark.parametrize(
    "requested,device,has_bf16,name,scaler",
    [
        ("auto", "cpu", False, "fp32", False),
        ("auto", "cuda", True, "bf16", False),
        ("auto", "cuda", False, "fp16", True),
        ("fp32", "cuda", True, "fp32", False),
        ("bf16", "cpu", False, "bf16", False),
        ("fp16", "cuda", True, "fp16", True),
    ],
)
def test_precision_choice(requested, device, has_bf16, name, scaler):
    precision = choose_precision(requested, device, has_bf16)
    assert precision.name == name and precision.grad_scaler == scaler
    assert precision.autocast == (name != "fp32")
    assert precision.weight_dtype(full=True) == torch.float32  # fp32 masters
    assert precision.weight_dtype(full=False) == precision.compute_dtype
    assert name in precision.describe()


def test_precision_errors_and_reasons():
    with pytest.raises(FinetuneError, match="fp16 needs a CUDA GPU"):
        choose_precision("fp16", "cpu", False)
    with pytest.raises(FinetuneError, match="no native bfloat16"):
        choose_precision("bf16", "cuda", False)
    assert "loss scaling" in choose_precision("auto", "cuda", False).describe()
    assert "supports bfloat16" in choose_precision("auto", "cuda", True).reason


# ----------------------------------------------------------------------------- summary


def test_comparison_table_and_loss_rows():
    assert loss_rows(5) == [0, 1, 2, 3, 4]
    rows = loss_rows(100)
    assert len(rows) == 12 and rows[0] == 0 and rows[-1] == 99
    base = RunResult("HF + PEFT", losses=[2.0, 1.5], timed_tokens=100, timed_seconds=1.0)
    fused = RunResult("HF + PEFT + fusetune", losses=[2.0, 1.25], timed_tokens=300)
    fused.timed_seconds, base.peak_memory, fused.peak_memory = 1.0, 2 * 1024**3, 1024**3
    base.memory_kind = fused.memory_kind = "cuda"
    table = format_comparison(base, fused)
    assert "-2.50e-01" in table and "3.00x" in table and "0.50x" in table


# ----------------------------------------------------------------------------- bench e2e


def test_bench_e2e_cpu_smoke(tmp_path, capsys):
    from fusetune.bench import cases_e2e, memory_peak

    variants = list(cases_e2e.DEFAULT_VARIANTS)  # unsloth: test_bench_e2e_unsloth_missing_*
    argv = ["--shapes", "qwen2.5-0.5b", "--steps", "1", "--warmup", "1", "--batch", "1"]
    argv += ["--seq-len", "16", "--tiny", "--out", str(tmp_path), "--variants", ",".join(variants)]
    assert cases_e2e.main([*argv, "--memory-peak"]) == 0
    out = capsys.readouterr().out
    assert "hf+peft+fusetune" in out
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == variants
    fused = rows[variants.index("hf+peft+fusetune")]["memory_peak"]
    if torch.cuda.is_available():  # what the step held, named by where it was allocated
        assert fused[0].startswith("peak of one step") and len(fused) > 2, fused
    else:
        assert fused == [memory_peak.NOT_CUDA] and memory_peak.NOT_CUDA in out
    liger = rows[variants.index("hf+peft+liger")]
    liger_runs = torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None
    if not torch.cuda.is_available():
        assert liger["note"] == "skipped: Liger-Kernel needs CUDA" and liger["note"] in out
    elif not liger_runs:  # a GPU machine without the peer: the row says why
        assert "liger_kernel" in liger["error"], liger
    assert all(r["tokens_per_s"] > 0 for r in rows if r is not liger or liger_runs)


def test_bench_e2e_unsloth_missing_gives_an_error_row(tmp_path, capsys, monkeypatch):
    """Without unsloth the variant leaves the defaults and, asked for, is one row that says why
    (no model is built, the table still prints, the run does not fail)."""
    from fusetune.bench import cases_e2e

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "unsloth" else real(name, *a)
    )
    assert "unsloth" not in cases_e2e.default_variants()
    argv = ["--shapes", "llama-3.2-1b", "--variants", "unsloth", "--tiny", "--out", str(tmp_path)]
    assert cases_e2e.main(argv) == 0
    out = capsys.readouterr().out
    (row,) = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert row["variant"] == "unsloth" and "unsloth is not installed" in row["error"], row
    assert "ERROR unsloth is not installed" in out
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert cases_e2e.default_variants()[-1] == "unsloth"


def test_bench_e2e_worker_subprocess_reports_json():
    from fusetune.bench import cases_e2e

    job = dict(shape="llama-3.2-1b", variant="hf+peft", batch=1, seq_len=16, device="cpu")
    result = cases_e2e._run_isolated({**job, "tiny": True, "steps": 1, "warmup": 1}, 120)
    assert "error" not in result, result
    assert result["variant"] == "hf+peft" and result["tokens_per_s"] > 0


def test_llama_step_flops_match_the_issue():
    from fusetune.bench import cases_e2e

    tflop = cases_e2e.flops(cases_e2e.SHAPES["llama-3.2-1b"], 4, 2048) / 1e12
    assert 46 < tflop < 48
