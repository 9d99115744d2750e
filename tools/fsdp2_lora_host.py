"""Host time of a PEFT LoRA step under FSDP2: every parameter sharded (FSDP2 as usually applied)
against fusetune.integrations.fsdp.shard_lora (the frozen base sharded, the adapters
replicated). CPU time of the process per step (time.process_time, one thread), so the narrow
default model measures the Python that issues a step; on a GPU pass --hidden 2048 etc.

    torchrun --nproc_per_node 2 tools/fsdp2_lora_host.py [--fusetune] [--layers 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import peft
import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

from fusetune.integrations.fsdp import shard_lora


def build(args) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    model = peft.get_peft_model(model, lora)
    if args.fusetune:
        import fusetune

        fusetune.apply(model)
    return model


def host_ms(model, layout: str, steps: int) -> list[float]:
    if layout == "shard_lora":
        shard_lora(model)
    else:
        for layer in model.get_base_model().model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 256, (2, 16))
    times = []
    for index in range(steps + 3):
        start = time.process_time()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if index >= 3:
            times.append((time.process_time() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fusetune", action="store_true", help="fusetune.apply the model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for layout in ("all-sharded", "shard_lora"):
        times = host_ms(build(args), layout, args.steps)
        if dist.get_rank() == 0:
            print(f"{layout:12s} {dist.get_world_size()} ranks, {args.layers} layers: CPU ms per "
                  f"step min/median/max {min(times):.1f} / {statistics.median(times):.1f} / "
                  f"{max(times):.1f}", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
