"""One launch of ``bench e2e --nproc N``: every rank of a torchrun group builds one variant's
model, wraps it in the engine, times the steps, and rank 0 prints one ``RESULT {json}`` line
(a rank that fails prints ``RESULT {"error": ...}`` first, so the parent can name the error).

Models (random weights, shapes of ``cases_e2e.SHAPES``), fp32 parameters:
- full fine-tuning under FSDP2: the head untied and sharded on its own (as torchtitan does; the
  layout where a fused loss must gather a sharded head), every decoder layer, then the root;
- LoRA (PEFT r=16 alpha=32 on every linear layer, base frozen) under FSDP2: the real tied
  embeddings, the head in the root group; variants hf-shard-lora and fusetune-shard-lora shard
  the base alone (fusetune.integrations.fsdp.shard_lora: the adapters replicated, in fp32);
- ZeRO-3 (either mode): the real tied embeddings, DeepSpeed partitions everything;
- DDP (either mode): the model whole on every rank in torch's DistributedDataParallel (LoRA's
  usual data parallel with HF / accelerate), bf16 autocast over the fp32 parameters; variant
  fusetune-graph (LoRA) has no DDP wrapper: ``fusetune.graph_train_step`` with the process group
  averages the adapters' gradients inside its CUDA graph (its fused-loss calls are the eager
  warm-up steps' and the capture's: the replays run no Python).
FSDP2 runs with ``MixedPrecisionPolicy(bf16 parameters, fp32 reductions)``, fp32 masters and
torch's fused AdamW; ZeRO-3 with ``bf16`` on (bf16 parameters, fp32 masters) and
``"torch_adam": true`` (no DeepSpeed CUDA op to build). On a machine without a GPU: gloo, tiny
configs (the plumbing's smoke run).

Usage: torchrun --nproc_per_node N -m fusetune.bench.distributed_worker '[{"engine": ...}]'
(``python -m fusetune bench e2e --nproc N`` writes the jobs: several variants of one FSDP2
configuration share a launch, Liger and ZeRO-3 runs get one each).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from fusetune.bench.cases_e2e import (
    ALPHA,
    RANK,
    SHAPES,
    _targets,
    apply_liger,
    model_config,
    profile_step,
)
from fusetune.bench.harness import synchronize
from fusetune.bench.memory_peak import live_at_peak
from fusetune.graphed_step import DEFAULT_WARMUP

TAG = "RESULT "
LR = 1e-5


def setup() -> torch.device:
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    return device


# Liger's fused linear cross-entropy reads lm_head.weight outside the head's forward: on a head
# FSDP2 shards on its own (full mode here, as torchtitan) that is a DTensor shard, and its matmul
# fails ("mixed torch.Tensor and DTensor", Liger issues #332 and #868). A Liger user there turns
# the fused loss off and keeps Liger's cross-entropy on the logits: so does the bench, and says so.
LIGER_OPTIONS = {("fsdp2", "full"): {"fused_linear_cross_entropy": False, "cross_entropy": True}}
LIGER_NOTES = {("fsdp2", "full"): "Liger's fused linear CE off (it fails on the sharded head)"}


def build(job: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """The variant's fp32 model: Liger patched in before building, PEFT LoRA, fusetune.apply."""
    import transformers

    shape = SHAPES[job["shape"]]
    if job["variant"] == "liger":
        apply_liger(shape.model_type, **LIGER_OPTIONS.get((job["engine"], job["mode"]), {}))
    config = model_config(shape, job["tiny"], layers=job.get("layers"))
    if job["engine"] == "fsdp2" and job["mode"] == "full":
        config.tie_word_embeddings = False  # a head of its own, to shard on its own
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.config.use_cache = False
    if job["mode"] == "lora":
        import peft

        lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                               target_modules=_targets(shape))  # fmt: skip
        model = peft.get_peft_model(model, lora)
        for name, param in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero; trained adapters are not
                torch.nn.init.normal_(param, std=0.02)
    if job["variant"].startswith("fusetune"):
        import fusetune

        fusetune.apply(model)
    return model


def fsdp2_step(model: torch.nn.Module, untied_head: bool, replicate_adapters: bool = False,
               keep_gathered: bool = False):  # fmt: skip
    """The step under FSDP2; ``replicate_adapters``: shard_lora's layout (the base sharded,
    the adapters whole on every rank, in fp32: the policy casts only what FSDP2 manages);
    ``keep_gathered``: reshard_after_forward=False."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fusetune.integrations.fsdp import shard_lora

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options = dict(mp_policy=policy, reshard_after_forward=not keep_gathered)
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    if replicate_adapters:
        shard_lora(model, layers=list(causal.model.layers), **options)
    else:
        for layer in causal.model.layers:
            fully_shard(layer, **options)
        if untied_head:
            fully_shard(causal.lm_head, **options)
        fully_shard(model, **options)
    trained = [p for p in model.parameters() if p.requires_grad]
    fused = next(iter(trained)).device.type == "cuda"
    optimizer = torch.optim.AdamW(trained, lr=LR, fused=fused)

    def step(ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def compile_each_layer(model: torch.nn.Module, device: torch.device) -> None:
    """Each decoder layer compiled on its own after FSDP2 sharded it (torchtitan's way: the
    layers share graphs, FSDP2's hooks stay between them); Inductor on GPUs, aot_eager on the
    CPU (no code generation in the smoke runs)."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    options = {} if device.type == "cuda" else {"backend": "aot_eager"}
    for layer in causal.model.layers:
        layer.compile(**options)


def ddp_step(model: torch.nn.Module, device: torch.device, graphed: bool):
    """The step with the model whole on every rank: DDP, or (``graphed``) one CUDA graph a step
    with the trainable gradients averaged inside it (built at the first call, from its batch)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    cuda = device.type == "cuda"
    if graphed:
        import fusetune

        lr = torch.tensor(LR, device=device)
        optimizer = torch.optim.AdamW(trained, lr=lr, fused=True, capturable=True)
        built = []

        def graph_step(ids: torch.Tensor) -> None:
            if not built:
                built.append(fusetune.graph_train_step(model, optimizer, ids,
                                                       autocast_dtype=torch.bfloat16,
                                                       process_group=dist.group.WORLD))  # fmt: skip
            built[0](ids)

        return graph_step
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(trained, lr=LR, fused=cuda)

    def step(ids: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def zero3_step(model: torch.nn.Module, batch: int):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=config)

    def step(ids: torch.Tensor) -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    return step


def count_fused_calls() -> list[int]:
    """fusetune's fused linear cross-entropy calls from causal-LM forwards (one per step when
    the fused path serves every step); the list is cleared for each variant."""
    from fusetune.integrations import _transformers_forwards as forwards

    fused = forwards.linear_cross_entropy
    calls = getattr(fused, "calls", None)
    if calls is None:  # counted once per process
        calls = []

        def counted(*args, **kwargs):
            calls.append(1)
            return fused(*args, **kwargs)

        counted.calls = calls
        forwards.linear_cross_entropy = counted
    calls.clear()
    return calls


def time_steps(step, ids: torch.Tensor, warmup: int, steps: int) -> tuple[list[float], list[str]]:
    """Step times (ms) after ``warmup`` untimed steps, and fusetune's fallback warnings."""
    times = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(warmup + steps):
            synchronize(ids.device)
            start = time.perf_counter()
            step(ids)
            synchronize(ids.device)
            if index >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
    messages = sorted({str(w.message) for w in caught})
    for message in messages:  # seen in the log, once each
        print(f"warning: {message}", file=sys.stderr)
    return times, [m for m in messages if m.startswith("fusetune")]


def measure(job: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One variant's steps; peak memory while training, above what was allocated before its
    model (zero when the previous variant of the launch was freed). The peak counts from after
    the engine sharded the model: every rank builds it whole in fp32 first (for an 8B model
    30 GiB, more than a sharded LoRA step needs at 4 GPUs), as a real run loading weights
    straight into shards does not."""
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    model = build(job, device)
    vocab = model.config.vocab_size
    calls = count_fused_calls()
    if job["engine"] == "zero3":
        step = zero3_step(model, job["batch"])
    elif job["engine"] == "ddp":
        step = ddp_step(model, device, graphed=job["variant"] == "fusetune-graph")
    else:
        step = fsdp2_step(model, untied_head=job["mode"] == "full",
                          replicate_adapters="-shard-lora" in job["variant"],
                          keep_gathered=job.get("keep_gathered", False))  # fmt: skip
        if job["variant"].endswith("-compiled"):
            compile_each_layer(model, device)
    gc.collect()  # what sharding released, before the training peak starts counting
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    generator = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, vocab, (job["batch"], job["seq_len"]), generator=generator)
    # a graphed step's eager calls and its capture stay out of the timing; they alone run the
    # model's Python (the replays do not), so they are its fused-loss calls
    graphed = job["variant"] == "fusetune-graph"
    warmup = max(job["warmup"], DEFAULT_WARMUP + 1) if graphed else job["warmup"]
    times, fallbacks = time_steps(step, ids.to(device), warmup, job["steps"])
    median = statistics.median(times)
    profile = None
    if job.get("profile") and device.type == "cuda":  # every rank steps (collectives)
        profile = profile_step(lambda: step(ids.to(device)))
        profile["wall_ms"] = median
    memory_peak = None
    if job.get("memory_peak"):  # every rank steps (collectives)
        memory_peak = live_at_peak(lambda: step(ids.to(device)), device)
    peak = None
    if device.type == "cuda":
        most = torch.tensor(float(torch.cuda.max_memory_allocated(device) - base), device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the largest rank's peak
        peak = most.item() / 2**30
    tokens = job["batch"] * job["seq_len"]
    ran = DEFAULT_WARMUP + 1 if graphed else warmup + job["steps"] + 2 * bool(profile)
    ran += bool(memory_peak) and device.type == "cuda"  # (off CUDA it runs no step)
    return dict(variant=job["variant"], world=dist.get_world_size(), step_ms=median,
                step_ms_min=min(times), step_ms_max=max(times),
                tokens_per_s_per_gpu=tokens / (median * 1e-3), peak_gib_per_gpu=peak,
                fused_calls=len(calls), steps=ran,
                fallback_warnings=fallbacks, profile=profile, memory_peak=memory_peak,
                note=_note(job))  # fmt: skip


def _note(job: dict[str, Any]) -> str:
    return LIGER_NOTES.get((job["engine"], job["mode"]), "") if job["variant"] == "liger" else ""


def main(spec: str) -> int:
    """``spec``: a JSON list of jobs (variants of one engine, mode and shape) run one after
    the other in this process group, each model freed before the next is built."""
    warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
    device = setup()
    failed = False
    for job in json.loads(spec):
        try:
            result = measure(job, device)
        except Exception as exc:  # noqa: BLE001 - the parent's error row names it
            text = str(exc).strip()
            message = f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
            result, failed = {"variant": job["variant"], "error": message}, True
            print(TAG + json.dumps(result), flush=True)  # every rank: the first to fail
        else:
            if dist.get_rank() == 0:
                print(TAG + json.dumps(result), flush=True)
        gc.collect()  # the model, its engine and optimizer state, before the next variant
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
