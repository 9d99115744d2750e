"""QLoRA training step on one GPU: a random-weight model whose linear layers are bitsandbytes NF4
(double quantisation, bf16 compute), PEFT LoRA r=16 on every linear layer (fp32 adapters, bf16
autocast), fused AdamW, sequence 2048: tokens/s and peak GiB for HF+PEFT+bitsandbytes and for
the same with fusetune applied. One variant per process.

Usage: PYTHONPATH=src python tools/bench_qlora.py --shape llama-3.2-1b --batch 4 --variant fusetune
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from fusetune.bench import cases_e2e
from fusetune.finetune.models import quantize_4bit

LLAMA_8B = cases_e2e.Shape(
    "Llama-3-8B", "llama",
    dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1 << 20,
         rms_norm_eps=1e-5),
    batch=2,
)  # fmt: skip
SHAPES = {**cases_e2e.SHAPES, "llama-8b": LLAMA_8B}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--variant", choices=["hf", "fusetune"], required=True)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    import peft
    import transformers

    shape, device = SHAPES[args.shape], torch.device("cuda")
    batch = args.batch or shape.batch
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            cases_e2e.model_config(shape, tiny=False), dtype=torch.bfloat16,
            attn_implementation="sdpa",
        )  # fmt: skip
    model.config.use_cache = False
    quantize_4bit(model)
    torch.cuda.empty_cache()
    config = peft.LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=cases_e2e.TARGETS
    )
    model = peft.get_peft_model(model, config)
    if args.variant == "fusetune":
        import fusetune

        fusetune.apply(model)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.randint(0, model.config.vocab_size, (batch, 2048), device=device)
    step = cases_e2e.make_step(model, ids)
    times = cases_e2e._time_steps(step, device, 2 + args.steps)[2:]
    median = statistics.median(times)
    print("RESULT " + json.dumps(dict(
        shape=shape.name, variant=args.variant, batch=batch, step_ms=median, min_ms=min(times),
        max_ms=max(times), tokens_per_s=batch * 2048 / median * 1e3,
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30,
    )), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
