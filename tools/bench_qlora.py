"""QLoRA training step on one GPU: a random-weight model whose linear layers are NF4 (double
quantisation, bf16 compute), LoRA r=16 on every linear layer (fp32 adapters, bf16 autocast),
fused AdamW, sequence 2048: tokens/s and peak GiB. One variant per process:

- ``hf``: HF + PEFT + bitsandbytes (fusetune's ``quantize_4bit`` puts bitsandbytes' Linear4bit in);
- ``fusetune``: the same with ``fusetune.apply``;
- ``liger``: the same with Liger-Kernel's patch for the family on the classes first (as bench
  e2e's ``hf+peft+liger``);
- ``unsloth``: the same random weights saved once under /tmp (bf16 safetensors), loaded by
  Unsloth's ``FastLanguageModel`` with ``load_in_4bit=True`` (its own NF4 through bitsandbytes).

``--gradient-checkpointing``: HF's ``gradient_checkpointing_enable(use_reentrant=False)`` for hf and
fusetune, Unsloth's own "unsloth" mode (layer inputs offloaded to host memory) for unsloth;
``--gradient-checkpointing offload``: fusetune's ``enable_offloaded_checkpointing`` (layer inputs
in pinned host memory, as Unsloth's mode) for hf and fusetune.
``--compile``: fusetune with its decoder stack compiled (``fusetune.compile_layers``, as bench e2e's
``hf+peft+fusetune+compile``; Unsloth compiles its decoder layers too); not with checkpointing.
``--plain-launches``: fusetune with each dequantisation launched plainly, not replayed from its
captured CUDA graph (``fusetune.ops.quant4.REPLAY``: the A/B of the replay).
``--largest-batch``: after the timed steps, the largest batch that fits: a line through the peaks
at the batch and at twice it (or the one peak) gives an estimate, then one step at each try,
5 % smaller after every out-of-memory error.

Usage: PYTHONPATH=src python tools/bench_qlora.py --shape llama-3.2-1b --batch 4 --variant fusetune
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch

from fusetune.bench import cases_e2e

LLAMA_8B = cases_e2e.Shape(
    "Llama-3-8B", "llama",
    dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1 << 20,
         rms_norm_eps=1e-5),
    batch=2,
)  # fmt: skip
SHAPES = {**cases_e2e.SHAPES, "llama-8b": LLAMA_8B}
SEQ_LEN = cases_e2e.SEQ_LEN
GIB = 2**30
MAX_TRIES = 6


def build(shape: cases_e2e.Shape, variant: str, checkpointing: str | None) -> torch.nn.Module:
    """The variant's 4-bit LoRA model on the GPU; ``checkpointing``: None, "on" or "offload"."""
    if variant == "unsloth":
        return cases_e2e.build_unsloth(
            shape, False, load_in_4bit=True, gradient_checkpointing=bool(checkpointing)
        )
    import peft
    import transformers

    from fusetune.finetune.models import quantize_4bit

    if variant == "liger":  # (before building: the model is then made of Liger's modules)
        cases_e2e.apply_liger(shape.model_type)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            cases_e2e.model_config(shape, tiny=False), dtype=torch.bfloat16,
            attn_implementation="sdpa",
        )  # fmt: skip
    model.config.use_cache = False
    quantize_4bit(model)
    torch.cuda.empty_cache()
    if checkpointing == "offload":
        from fusetune.integrations.checkpointing import enable_offloaded_checkpointing

        enable_offloaded_checkpointing(model)
    elif checkpointing:  # before PEFT wraps it; non-reentrant needs no input grads
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # its newer name in transformers
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    config = peft.LoraConfig(
        r=cases_e2e.RANK, lora_alpha=cases_e2e.ALPHA, lora_dropout=0.0,
        target_modules=cases_e2e.TARGETS,
    )  # fmt: skip
    model = peft.get_peft_model(model, config)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # as bench e2e: PEFT starts B at zero; trained adapters are not
            torch.nn.init.normal_(param, std=0.02)
    if variant == "fusetune":
        import fusetune

        fusetune.apply(model)
    return model


def one_step_peak(model: torch.nn.Module, batch: int) -> tuple[float, float] | None:
    """(step ms, peak bytes) of two steps at ``batch`` (the second timed), or None on OOM."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        ids = torch.randint(0, model.config.vocab_size, (batch, SEQ_LEN), device="cuda")
        step = cases_e2e.make_step(model, ids)
        times = cases_e2e._time_steps(step, torch.device("cuda"), 2)
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return None
    return times[-1], float(torch.cuda.max_memory_allocated())


def largest_batch(model: torch.nn.Module, batch: int) -> dict[str, object]:
    """The largest batch that ran one step (see the module doc)."""
    gc.collect()
    torch.cuda.empty_cache()  # so that the process holds only what is allocated
    fixed = float(torch.cuda.memory_allocated())
    free = torch.cuda.mem_get_info()[0] + fixed  # what this process may hold in all
    first = one_step_peak(model, batch)
    if first is None:
        return {"largest_batch": None, "oom_at": [batch]}
    second = one_step_peak(model, 2 * batch)
    if second is not None:
        per_sequence = max(second[1] - first[1], 1.0) / batch
        intercept = first[1] - per_sequence * batch
    else:
        per_sequence, intercept = max(first[1] - fixed, 1.0) / batch, fixed
    estimate = max(batch, int((free * 0.97 - intercept) // per_sequence))
    print(
        f"estimate: batch {estimate} ({per_sequence / GIB:.3f} GiB a sequence, "
        f"{free / GIB:.1f} GiB to hold)",
        flush=True,
    )
    tried, best = [], (batch, *first)
    if second is not None:
        best = (2 * batch, *second)
    candidate = estimate
    for _ in range(MAX_TRIES):
        if candidate <= best[0]:
            break
        found = one_step_peak(model, candidate)
        print(f"try batch {candidate}: {'fits' if found else 'out of memory'}", flush=True)
        if found is not None:
            best = (candidate, *found)
            break
        tried.append(candidate)
        candidate = min(candidate - 1, int(candidate * 0.95))
    size, ms, peak = best
    return {
        "largest_batch": size, "largest_batch_estimate": estimate, "oom_at": tried,
        "largest_batch_tokens_per_s": size * SEQ_LEN / ms * 1e3,
        "largest_batch_peak_gib": peak / GIB, "per_sequence_gib": per_sequence / GIB,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--variant", choices=["hf", "liger", "fusetune", "unsloth"], required=True)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--gradient-checkpointing", nargs="?", const="on", choices=["on", "offload"], default=None
    )
    parser.add_argument("--largest-batch", action="store_true")
    parser.add_argument("--compile", action="store_true", help="fusetune's stack compiled")
    parser.add_argument("--graph", action="store_true",
                        help="the step as one CUDA graph (fusetune.graph_train_step)")  # fmt: skip
    parser.add_argument("--plain-launches", action="store_true",
                        help="fusetune's dequantisations launched, not replayed")  # fmt: skip
    args = parser.parse_args()
    if args.compile and (args.variant != "fusetune" or args.gradient_checkpointing):
        parser.error("--compile: the fusetune variant, without --gradient-checkpointing")
    if args.graph and args.variant == "unsloth":
        parser.error("--graph: the fusetune and hf variants (fusetune.graph_train_step)")
    if args.plain_launches:
        from fusetune.ops import quant4

        quant4.REPLAY = False
    shape = SHAPES[args.shape]
    batch = args.batch or shape.batch
    model = build(shape, args.variant, args.gradient_checkpointing)
    if args.compile:
        import fusetune

        fusetune.compile_layers(model)
    fixed = torch.cuda.memory_allocated() / GIB
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, model.config.vocab_size, (batch, SEQ_LEN), device="cuda")
    step = cases_e2e.make_step(model, ids, graph=args.graph)
    untimed = 4 if args.compile or args.graph else 2  # compiling; the graph's 3 eager steps
    times = cases_e2e._time_steps(step, torch.device("cuda"), untimed + args.steps)[untimed:]
    median = statistics.median(times)
    result = dict(
        shape=shape.name, variant=args.variant + ("+compile" if args.compile else "")
        + ("+graph" if args.graph else "")
        + ("+plain-launches" if args.plain_launches else ""), batch=batch,
        gradient_checkpointing=args.gradient_checkpointing, step_ms=median, min_ms=min(times),
        max_ms=max(times), tokens_per_s=batch * SEQ_LEN / median * 1e3,
        peak_gib=torch.cuda.max_memory_allocated() / GIB, weights_gib=fixed,
        adapter_dtype=cases_e2e.unsloth_variant.adapter_dtype(model),
        checkpointed_layers=cases_e2e.unsloth_variant.checkpointed_layers(model),
    )  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    if args.largest_batch:
        del step, ids
        result.update(largest_batch(model, batch))
        print("LARGEST " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
