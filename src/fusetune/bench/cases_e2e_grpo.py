"""End-to-end GRPO benchmark: one optimisation step of TRL's GRPOTrainer on a finished
generation batch (the log-prob head, the loss, backward and the AdamW step; generation is not in
the step and is not timed here).

Shape: Qwen2.5-0.5B built from its config with random weights (bf16 base, PEFT LoRA r=16
alpha=32 on every linear layer, fp32 adapters), 8 prompts x 8 completions of 512 tokens after a
128-token prompt, micro-batches of 8 sequences (8 accumulation steps per optimisation step),
TRL's defaults otherwise (loss_type, beta), bf16 autocast as GRPOConfig(bf16=True) runs it.

Variants, each in its own subprocess: ``trl`` (GRPOTrainer as it is: TRL's fused LM head and
loss), ``trl+liger`` (``use_liger_kernel=True``: Liger's layer kernels; TRL keeps its head),
``trl+fusetune`` (``fusetune.apply(trainer)``: fusetune's backbone ops and head).

    python -m fusetune bench e2e-grpo [--variants trl,trl+fusetune] [--steps 5] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from fusetune.bench.cases_e2e import ALPHA, GIB, RANK, SHAPES, TARGETS, model_config
from fusetune.bench.harness import environment, synchronize

VARIANTS = ("trl", "trl+liger", "trl+fusetune")
RESULT_TAG = "E2E_GRPO_RESULT "
PROMPTS, GENERATIONS, PROMPT_LEN, COMPLETION_LEN, MICRO_BATCH = 8, 8, 128, 512, 8
FULL = dict(prompts=PROMPTS, generations=GENERATIONS, prompt_len=PROMPT_LEN,
            completion_len=COMPLETION_LEN, micro_batch=MICRO_BATCH)  # fmt: skip
TINY = dict(prompts=2, generations=2, prompt_len=8, completion_len=8, micro_batch=2)


def _tokenizer(vocab_size: int):
    """A word-level tokenizer (token i is ``t{i}``): TRL wants one for padding and EOS."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(min(vocab_size, 1024))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="t1", eos_token="t2"
    )


def build_trainer(variant: str, device: torch.device, tiny: bool, sizes: dict[str, int]):
    """A GRPOTrainer around a fresh random-weight LoRA model, patched for ``variant``."""
    import datasets
    import peft
    import transformers
    import trl

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    shape = SHAPES["qwen2.5-0.5b"]
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            model_config(shape, tiny),
            dtype=torch.bfloat16 if cuda else torch.float32,
            attn_implementation="sdpa",
        )
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)
    model = peft.get_peft_model(model, lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; trained adapters are not
            torch.nn.init.normal_(param, std=0.02)
    sequences = sizes["prompts"] * sizes["generations"]
    args = trl.GRPOConfig(
        output_dir="/tmp/fusetune-bench-e2e-grpo",
        per_device_train_batch_size=sizes["micro_batch"],
        gradient_accumulation_steps=sequences // sizes["micro_batch"],
        num_generations=sizes["generations"],
        max_completion_length=sizes["completion_len"],
        bf16=cuda,
        use_cpu=not cuda,
        use_liger_kernel=variant == "trl+liger",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    # One process on a host of several GPUs trains on the first, as Trainer does for a model it
    # splits: not in nn.DataParallel, which GRPOTrainer refuses (`fusetune grpo` hides the others)
    if args.device.type == "cuda":
        args._n_gpu = 1
    prompts = datasets.Dataset.from_list([{"prompt": "t3 t4"}] * sequences)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=prompts,
        processing_class=_tokenizer(model.config.vocab_size),
    )
    if variant == "trl+fusetune":
        import fusetune

        fusetune.apply(trainer)
    return trainer


def micro_batches(vocab: int, device: torch.device, sizes: dict[str, int]) -> list[dict]:
    """The generation batch split as GRPOTrainer buffers it: prompt and completion ids with
    their masks (completions of random lengths), advantages, the batch's completion tokens."""
    sequences = sizes["prompts"] * sizes["generations"]
    prompt = torch.randint(3, vocab, (sequences, sizes["prompt_len"]), device=device)
    completion = torch.randint(3, vocab, (sequences, sizes["completion_len"]), device=device)
    length = torch.randint(sizes["completion_len"] // 2, sizes["completion_len"] + 1,
                           (sequences, 1), device=device)  # fmt: skip
    completion_mask = (torch.arange(sizes["completion_len"], device=device) < length).long()
    advantages = torch.randn(sequences, device=device)
    total = completion_mask.sum()
    size = sizes["micro_batch"]
    return [
        dict(
            prompt_ids=prompt[i : i + size],
            prompt_mask=torch.ones_like(prompt[i : i + size]),
            completion_ids=completion[i : i + size],
            completion_mask=completion_mask[i : i + size],
            advantages=advantages[i : i + size],
            num_items_in_batch=total,
        )
        for i in range(0, sequences, size)
    ]


def measure(variant: str, device: torch.device, tiny: bool, warmup: int, steps: int) -> dict:
    sizes = TINY if tiny else FULL
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    trainer = build_trainer(variant, device, tiny, sizes)
    model = trainer.model
    model.train()
    batches = micro_batches(model.config.vocab_size, device, sizes)
    trainer.current_gradient_accumulation_steps = len(batches)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=cuda)

    def step() -> None:
        for inputs in batches:
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, inputs)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for index in range(warmup + steps):
        start = time.perf_counter()
        step()
        synchronize(device)
        if index >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    tokens = sum(int(b["completion_mask"].sum()) + b["prompt_ids"].numel() for b in batches)
    step_ms = statistics.median(times)
    result = {
        "variant": variant,
        "step_ms": step_ms,
        "step_ms_all": times,
        "tokens_per_s": tokens / (step_ms * 1e-3),
        "sequences": len(batches) * sizes["micro_batch"],
    }
    if cuda:
        result["peak_gib"] = (torch.cuda.max_memory_allocated(device) - base) / GIB
    return result


def _run_isolated(job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "fusetune.bench.cases_e2e_grpo", "--worker", json.dumps(job)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env=env, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"variant": job["variant"], "error": f"timed out after {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return {"variant": job["variant"], "error": tail[-1][:200] if tail else "no result"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusetune bench e2e-grpo")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (smoke run)")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        warnings.filterwarnings("ignore")
        job = json.loads(args.worker)
        device = torch.device(job["device"])
        result = measure(job["variant"], device, job["tiny"], job["warmup"], job["steps"])
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    rows = []
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        job = dict(variant=variant, device=str(device), tiny=tiny, warmup=args.warmup,
                   steps=args.steps)  # fmt: skip
        row = _run_isolated(job, args.timeout)
        rows.append(row)
        print(_format_row(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device, tiny)
    (out / "e2e_grpo.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 1 if any("error" in r for r in rows if r["variant"] == "trl+fusetune") else 0


def _format_row(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['variant']:<14} error: {row['error']}"
    times = row["step_ms_all"]
    memory = f", {row['peak_gib']:.2f} GiB" if "peak_gib" in row else ""
    spread = f"(min {min(times):.1f}, max {max(times):.1f})"
    speed = f"{row['tokens_per_s'] / 1e3:8.1f}k tokens/s"
    return f"{row['variant']:<14} {speed}  step median {row['step_ms']:.1f} ms {spread}{memory}"


if __name__ == "__main__":
    sys.exit(main())
