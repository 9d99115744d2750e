"""Full fine-tuning under FSDP2 on N GPUs: tokens/s per GPU and peak GiB per GPU for HF,
HF + Liger-Kernel and HF + fusetune (the lm_head sharded on its own, as torchtitan does), one
variant per torchrun launch. Random-weight Llama-3.2-1B shape, bf16 parameters with fp32
reductions (MixedPrecisionPolicy) and fp32 masters, AdamW, sequence 2048, batch per GPU 4.

Usage: torchrun --nproc_per_node N tools/bench_fsdp2.py --variant fusetune [--steps 8]
(tools/gpu_distributed.sh runs every variant at 1 and 2 GPUs and prints the scaling.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from fusetune.bench.cases_e2e import SHAPES, model_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=["hf", "liger", "fusetune"], required=True)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    import transformers

    shape = SHAPES[args.shape]
    if args.variant == "liger":
        from fusetune.bench.cases_e2e import apply_liger

        apply_liger(shape.model_type)
    torch.manual_seed(0)
    config = model_config(shape, tiny=False)
    config.tie_word_embeddings = False  # a head of its own, to shard on its own
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if args.variant == "fusetune":
        import fusetune

        fusetune.apply(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model.lm_head, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    calls = []
    if args.variant == "fusetune":
        from fusetune.integrations import _transformers_forwards as forwards

        fused = forwards.linear_cross_entropy
        forwards.linear_cross_entropy = lambda *a, **k: calls.append(1) or fused(*a, **k)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), device=device)
    times = []
    torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    result = dict(variant=args.variant, shape=shape.name, world=world, step_s=median,
                  step_s_min=min(times), step_s_max=max(times),
                  tokens_per_s_per_gpu=args.batch * args.seq_len / median,
                  peak_gib_per_gpu=torch.cuda.max_memory_allocated(device) / 2**30,
                  fused_calls=len(calls), steps=args.warmup + args.steps)  # fmt: skip
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
