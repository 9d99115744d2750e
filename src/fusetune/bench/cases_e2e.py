"""End-to-end benchmark: one LoRA training step (forward, backward, AdamW step) of whole models.

Shapes: Llama-3.2-1B (batch 4) and Qwen2.5-0.5B (batch 8), built from their configs with random
weights (no download), bf16 base weights, PEFT LoRA r=16 alpha=32 on every linear layer (q, k,
v, o, gate, up, down) with fp32 adapters (PEFT's default), the step under bf16 autocast (as HF
Trainer's ``bf16=True`` runs it), sdpa attention, sequence 2048, labels = inputs (every token
trained), fused AdamW on the adapters, no gradient checkpointing.

Variants: ``hf+peft`` (transformers + PEFT as they are), ``hf+peft+liger`` (Liger-Kernel's
``apply_liger_kernel_to_llama`` / ``_qwen2``, all its defaults: RMSNorm, RoPE, SwiGLU, fused
linear cross-entropy), ``hf+peft+fusetune`` (``fusetune.integrations.transformers.apply`` on
the PEFT model: RMSNorm, RoPE, linear cross-entropy and the fused LoRA projections and MLP),
``unsloth`` (the same random weights saved to a folder under /tmp once per shape and loaded with
Unsloth's ``FastLanguageModel``, its ``get_peft_model`` with the same LoRA settings: see
``fusetune.bench.unsloth_variant``; in the defaults only where unsloth is importable, and a row
that says why where it is not).

``python -m fusetune bench e2e`` runs each variant in its own subprocess (a fresh model, and
no patch can leak from one variant into the next: Liger patches transformers' modules for the
whole process), prints tokens/s, the step's median time, the peak memory of the whole run
(weights, adapters, optimizer state and activations: ``torch.cuda.max_memory_allocated``) and
the largest batch each variant fits, and writes ``e2e.json`` and ``e2e.txt``. The largest
batch is found cheaply: peak memory is affine in the batch (weights and optimizer state fixed,
activations per sequence), so one measured run gives the estimate
``(free memory - fixed) / per-sequence``, and ``--max-batch verify`` then runs one step at the
estimate (stepping down 10 % after an out-of-memory error, at most 3 tries). On a machine
without a GPU the command is a smoke run: tiny configs, in one process, no Liger.

Registered cases (op ``e2e``) run the same steps through the generic harness
(``python -m fusetune bench``): time, and peak memory above the weights and optimizer state;
HF + PEFT and fusetune only (Liger's process-wide patches need the subprocess runner).

FLOP count (the floor): base matmuls forward and dx backward (no weight gradients: the base is
frozen), 2 x 2 x tokens x matmul parameters (lm_head included), plus attention QK^T and PV
counted in full (not halved for causality), forward + backward (3 x 4 B T^2 H d per layer):
47 TFLOP for the Llama step, as the issue counts it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusetune.bench import unsloth_variant
from fusetune.bench.harness import Case, environment, register, synchronize
from fusetune.bench.memory_peak import live_at_peak

SEQ_LEN = 2048
RANK, ALPHA = 16, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = ("hf+peft", "hf+peft+liger", "hf+peft+fusetune", "hf+peft+fusetune+compile", "unsloth",
            "hf+peft+compile", "hf+peft+compile+fused-loss", "hf+peft+fusetune+graph")  # fmt: skip
# +compile: the decoder stack compiled (opt-in): fusetune's layers, plain PEFT's (torch.compile's
# own step), or plain PEFT's with fusetune's fused loss alone (fused-loss); unsloth where it is
# installed (default_variants()). +graph: the whole step replayed from one CUDA graph
# (fusetune.graph_train_step, opt-in: fixed shapes).
DEFAULT_VARIANTS = VARIANTS[:3]
GIB = float(1024**3)
RESULT_TAG = "E2E_RESULT "
WORKER_TIMEOUT_S = 600
# Fraction of the free memory a batch may plan to use (fragmentation, cuBLAS workspaces).
MEMORY_HEADROOM = 0.97
VERIFY_TRIES = 3


@dataclass(frozen=True)
class Shape:
    name: str
    model_type: str
    config: dict[str, Any]
    batch: int
    targets: tuple[str, ...] | str = tuple(TARGETS)  # PEFT's target_modules
    default: bool = True  # in the default --shapes and a registered harness case


SHAPES = {
    "llama-3.2-1b": Shape(
        "Llama-3.2-1B",
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        batch=4,
    ),
    "qwen2.5-0.5b": Shape(
        "Qwen2.5-0.5B",
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        batch=8,
    ),
    # The 8B class (issue 17's scaling run, --nproc): LoRA at full depth fits one H100 at batch
    # 2; full fine-tuning's fp32 state (16 bytes a parameter) needs --layers 8 to fit one.
    "llama-3.1-8b": Shape(
        "Llama-3.1-8B",
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        batch=2,
        default=False,
    ),
    # Issue 19's families, on request (--shapes): the largest vocabulary, a fused gate_up, and a
    # hybrid of Gated DeltaNet and attention layers.
    "gemma3-1b": Shape(
        "Gemma-3-1B",
        "gemma3_text",
        dict(
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        batch=4,
        default=False,
    ),
    "phi3-mini": Shape(
        "Phi-3-mini",
        "phi3",
        dict(
            vocab_size=32064,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        batch=4,
        targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        default=False,
    ),
    # A small Qwen3.5-style hybrid (3 Gated DeltaNet layers to 1 attention layer); the FLOP
    # count treats every layer as attention, so its TFLOP/s is indicative only.
    "qwen3.5-small": Shape(
        "Qwen3.5-small",
        "qwen3_5_text",
        dict(
            vocab_size=248320,
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=24,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        batch=4,
        targets="all-linear",
        default=False,
    ),
}
DEFAULT_SHAPES = [key for key, shape in SHAPES.items() if shape.default]
# Liger-Kernel's patch per model type (its apply_liger_kernel_to_<name>)
LIGER_PATCHES = {"gemma3_text": "gemma3_text", "qwen3_5_text": "qwen3_5"}
# The CPU smoke run (and --tiny): the same families, a few thousand parameters.
TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,  # inside the tiny vocabulary (Phi-3's is 32000)
)
TINY_SEQ_LEN, TINY_BATCH = 64, 2


def model_config(shape: Shape, tiny: bool, layers: int | None = None) -> Any:
    """The shape's transformers config (tiny widths for smoke runs; ``layers``: that depth)."""
    import transformers

    settings = {**shape.config, **TINY_CONFIG} if tiny else dict(shape.config)
    if layers:
        settings["num_hidden_layers"] = layers
    return transformers.AutoConfig.for_model(shape.model_type, **settings)


# ----------------------------------------------------------------------------- one variant


def apply_liger(model_type: str, **options: bool) -> None:
    """Liger-Kernel's patch for the family on the classes, its defaults but ``options`` (before
    building: the model is then built from Liger's modules, as ``AutoLigerKernelForCausalLM``
    does)."""
    import liger_kernel.transformers as liger

    name = LIGER_PATCHES.get(model_type, model_type)
    getattr(liger, f"apply_liger_kernel_to_{name}")(**options)


def build(shape: Shape, variant: str, device: torch.device, tiny: bool) -> torch.nn.Module:
    """A fresh random-weight model of ``shape`` with LoRA adapters, patched for ``variant``."""
    import peft
    import transformers

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if variant == "unsloth":
        return build_unsloth(shape, tiny)
    if variant == "hf+peft+liger":
        apply_liger(shape.model_type)
    base_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            model_config(shape, tiny), dtype=base_dtype, attn_implementation="sdpa"
        )
    model.config.use_cache = False
    targets = _targets(shape)
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets)
    model = peft.get_peft_model(model, lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; trained adapters are not
            torch.nn.init.normal_(param, std=0.02)
    if variant == "hf+peft":  # the baseline imports nothing of fusetune's integrations
        return model
    from fusetune.integrations import transformers as hf_integration

    if variant.startswith("hf+peft+fusetune"):
        hf_integration.apply(model)
    elif variant.endswith("+fused-loss"):
        hf_integration.apply(model, rms_norm=False, rope=False, mlp=False, lora=False,
                             gated_delta=False, experts=False)  # fmt: skip
    if "+compile" in variant:
        hf_integration.compile_layers(model, mode=os.environ.get("FUSETUNE_COMPILE_MODE"))
    return model


def build_unsloth(
    shape: Shape, tiny: bool, seq_len: int | None = None, **options: Any
) -> torch.nn.Module:
    """Unsloth's LoRA model of ``shape`` from the saved random weights, for sequences up to
    ``seq_len`` (default: the bench's) (``options``: load_in_4bit, gradient_checkpointing).
    Raises RuntimeError without unsloth."""
    why = unsloth_variant.missing()
    if why:
        raise RuntimeError(why)
    folder = unsloth_variant.model_folder(
        shape.model_type, shape.config, TINY_CONFIG if tiny else None
    )
    seq_len = seq_len or (TINY_SEQ_LEN if tiny else SEQ_LEN)
    return unsloth_variant.load(folder, _targets(shape), RANK, ALPHA, seq_len, **options)


def _targets(shape: Shape) -> list[str] | str:
    return shape.targets if isinstance(shape.targets, str) else list(shape.targets)


STEP_PHASES = ("forward", "backward", "optimizer")


def make_step(
    model: torch.nn.Module, input_ids: torch.Tensor, mark_phases: bool = False, graph: bool = False
) -> Callable[[], torch.Tensor]:
    """One training step on ``input_ids`` (labels = inputs); returns the loss, unsynced.
    ``mark_phases``: each phase a profiler range named as in ``STEP_PHASES`` (tools/gpu_idle.py
    charges the GPU's idle time to them; off, the step is the bench's, unmarked). ``graph``:
    the same step through fusetune.graph_train_step (CUDA; its first 3 calls run eagerly)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if graph:
        from fusetune.graphed_step import graph_train_step

        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True,
                                      capturable=True)  # fmt: skip
        model.train()
        graphed = graph_train_step(model, optimizer, input_ids, autocast_dtype=torch.bfloat16)
        return lambda: graphed(input_ids)
    fused = input_ids.device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=fused)
    autocast = input_ids.device.type == "cuda"
    model.train()
    phase = torch.profiler.record_function if mark_phases else lambda name: contextlib.nullcontext()
    forward, backward, optimizer_step = STEP_PHASES

    def step() -> torch.Tensor:
        amp = torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=autocast)
        with phase(forward), amp:
            loss = model(input_ids=input_ids, labels=input_ids).loss
        with phase(backward):
            loss.backward()
        with phase(optimizer_step):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _time_steps(step: Callable[[], torch.Tensor], device: torch.device, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def flops(shape: Shape, batch: int, seq_len: int, tiny: bool = False) -> float:
    """The step's matmul FLOPs (see the module doc): base forward + dx, attention in full."""
    c = {**shape.config, **TINY_CONFIG} if tiny else shape.config
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    per_layer = hidden * (2 * q_out + 2 * kv_out) + 3 * hidden * c["intermediate_size"]
    params = layers * per_layer + hidden * c["vocab_size"]
    tokens = batch * seq_len
    attention = 3 * 4 * batch * seq_len**2 * q_out * layers
    return 2 * 2 * tokens * params + attention


def measure(
    shape: Shape,
    variant: str,
    batch: int,
    seq_len: int,
    device: torch.device,
    *,
    tiny: bool = False,
    warmup: int = 4,
    steps: int = 5,
    max_batch: str = "estimate",
    profile: bool = False,
    memory_peak: bool = False,
) -> dict[str, Any]:
    """Build, warm up, time ``steps`` steps; memory is the whole run's peak above what was
    allocated before the model existed."""
    cuda = device.type == "cuda"
    free_before = torch.cuda.mem_get_info(device)[0] if cuda else None
    base = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = build(shape, variant, device, tiny)
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (batch, seq_len), device=device)
    graph = variant.endswith("+graph")
    step = make_step(model, input_ids, graph=graph)
    first = _time_steps(step, device, 1)[0]
    _time_steps(step, device, max(0, warmup - 1))
    times = _time_steps(step, device, steps)
    step_ms = statistics.median(times)
    result: dict[str, Any] = {
        "shape": shape.name,
        "variant": variant,
        "batch": batch,
        "seq_len": seq_len,
        "step_ms": step_ms,
        "step_ms_all": times,
        "first_step_ms": first,
        "tokens_per_s": batch * seq_len / (step_ms * 1e-3),
        "tflops_per_s": flops(shape, batch, seq_len, tiny) / (step_ms * 1e-3) / 1e12,
        "adapter_dtype": unsloth_variant.adapter_dtype(model),
        "checkpointed_layers": unsloth_variant.checkpointed_layers(model),
    }
    if memory_peak and not graph:  # (a graph's replays allocate nothing)
        result["memory_peak"] = live_at_peak(step, device)
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) - base
        fixed = torch.cuda.memory_allocated(device) - base  # weights, adapters, AdamW state
        result.update(peak_gib=peak / GIB, fixed_gib=fixed / GIB)
        if max_batch != "off" and not graph:  # (a graph's pool holds the step's memory)
            per_sequence = max(peak - fixed, 1) / batch
            estimate = int((free_before * MEMORY_HEADROOM - fixed) // per_sequence)
            result.update(per_sequence_gib=per_sequence / GIB, max_batch_estimate=estimate)
            if max_batch == "verify":
                del input_ids, step
                result.update(_verify_max_batch(model, estimate, seq_len, vocab, device, base))
    if profile and cuda:
        result["profile"] = profile_step(  # (a graph: the captured step, replayed)
            step if graph else make_step(model, _ids(batch, seq_len, vocab, device))
        )
        result["profile"]["wall_ms"] = result.get("step_ms")
    return result


def _ids(batch: int, seq_len: int, vocab: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len), device=device)


def _verify_max_batch(model, estimate: int, seq_len: int, vocab: int, device, base: int):
    """Run steps at the estimated largest batch, 10 % smaller after each out-of-memory error."""
    batch, tried = estimate, []
    for _ in range(VERIFY_TRIES):
        if batch < 1:
            break
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            step = make_step(model, _ids(batch, seq_len, vocab, device))
            _time_steps(step, device, 1)
            step_ms = _time_steps(step, device, 1)[0]
        except torch.OutOfMemoryError:
            tried.append(batch)
            step = None
            model.zero_grad(set_to_none=True)
            batch = math.floor(batch * 0.9)
            continue
        peak = (torch.cuda.max_memory_allocated(device) - base) / GIB
        return {
            "max_batch_verified": batch,
            "max_batch_peak_gib": peak,
            "max_batch_tokens_per_s": batch * seq_len / (step_ms * 1e-3),
            "max_batch_oom_at": tried,
        }
    return {"max_batch_verified": None, "max_batch_oom_at": tried}


def profile_step(step: Callable[[], torch.Tensor], top: int = 15) -> dict[str, Any]:
    """CUDA time of one step: per kind of kernel (matmul, attention, optimizer, PyTorch
    elementwise, Triton, copies) and the ``top`` kernels by name; ``syncs``: the step's calls
    that wait for the GPU (cuda*Synchronize, blocking copies), each of which leaves the GPU
    idle while the host then issues what follows."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()  # (counted below as one cudaDeviceSynchronize: taken off)
    kernels, syncs = [], {"cudaDeviceSynchronize": -1}
    for event in prof.key_averages():
        if "Synchronize" in event.key or event.key == "cudaMemcpy":
            syncs[event.key] = syncs.get(event.key, 0) + event.count
        # the kernels themselves: not a CPU op (its device time is its kernels', counted there)
        # nor a range that record_function mirrors onto the GPU's timeline (it spans kernels)
        annotation = getattr(event, "is_user_annotation", False)
        if event.device_type == DeviceType.CUDA and not annotation and event.device_time_total > 0:
            ms = event.device_time_total / 1e3
            kernels.append({"kernel": event.key[:100], "ms": ms, "calls": event.count})
    kernels.sort(key=lambda r: -r["ms"])
    kinds: dict[str, float] = {}
    for kernel in kernels:
        kind = kernel_kind(kernel["kernel"])
        kinds[kind] = kinds.get(kind, 0.0) + kernel["ms"]
    syncs = {name: count for name, count in syncs.items() if count > 0}
    return {"kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])), "top": kernels[:top],
            "syncs": syncs}  # fmt: skip


def kernel_kind(name: str) -> str:
    """A CUDA kernel's kind, from its name (cuBLAS on Hopper: nvjet / sm90 xmma / cutlass).
    NCCL's kernels count the time they wait for the other ranks too: "collective", apart."""
    lower = name.lower()
    kinds = (
        ("collective", ("nccl",)),
        ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk")),
        ("attention", ("flash", "fmha", "attention", "sdpa")),
        ("optimizer", ("adam", "multi_tensor", "foreach")),
        ("copy", ("memcpy", "memset")),
        ("pytorch", ("at::", "elementwise", "reduce_kernel", "void ")),
    )
    for kind, needles in kinds:
        if any(needle in lower for needle in needles):
            return kind
    return "triton"


# ----------------------------------------------------------------------------- runner


def _worker(spec: str) -> int:
    """Subprocess entry: measure one variant, print its result as one tagged JSON line."""
    warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
    job = json.loads(spec)
    shape = SHAPES[job.pop("shape")]
    device = torch.device(job.pop("device"))
    result = measure(shape, job.pop("variant"), job.pop("batch"), job.pop("seq_len"), device, **job)
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


def _run_isolated(job: dict[str, Any], timeout_s: float, log: Path | None = None) -> dict[str, Any]:
    """Run one variant in a fresh interpreter; its stdout and stderr go to ``log``."""
    command = [sys.executable, "-m", "fusetune.bench.cases_e2e", "--worker", json.dumps(job)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
        stdout, stderr = done.stdout, done.stderr
        failure = f"exit status {done.returncode}"
    except subprocess.TimeoutExpired as exc:
        stdout, stderr = _text(exc.stdout), _text(exc.stderr)
        failure = f"timed out after {timeout_s:.0f} s"
    if log is not None:
        log.write_text(f"$ {' '.join(command)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n")
    for line in stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = [line for line in stderr.strip().splitlines() if line.strip()]
    if failure.startswith("timed out") or not tail:
        return {"error": failure}
    return {"error": tail[-1][:200]}


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def _run_in_process(job: dict[str, Any]) -> dict[str, Any]:
    job = dict(job)
    shape = SHAPES[job.pop("shape")]
    device = torch.device(job.pop("device"))
    try:
        return measure(
            shape, job.pop("variant"), job.pop("batch"), job.pop("seq_len"), device, **job
        )
    except Exception as exc:  # noqa: BLE001 - one variant failing must not end the run
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"}
    finally:
        gc.collect()


def run_e2e(
    args: argparse.Namespace, on_row: Callable[[list[dict[str, Any]]], None] | None = None
) -> list[dict[str, Any]]:
    """Every shape x variant; ``on_row(rows)`` after each (so a run cut off by a time limit
    keeps what it measured)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    isolate = device.type == "cuda" and not args.in_process
    seq_len = args.seq_len or (TINY_SEQ_LEN if tiny else SEQ_LEN)
    rows = []
    for key in args.shapes:
        shape = SHAPES[key]
        batch = args.batch or (TINY_BATCH if tiny else shape.batch)
        for variant in args.variants:
            name = f"{shape.name} (tiny)" if tiny else shape.name
            row = {"shape": name, "variant": variant, "batch": batch, "seq_len": seq_len}
            skipped = _not_run(variant, device, isolate)
            if skipped:
                rows.append({**row, **skipped})
                print(f"[e2e] {shape.name} | {variant} = {_brief(rows[-1])}", file=sys.stderr)
                if on_row is not None:
                    on_row(rows)
                continue
            job = dict(
                shape=key,
                variant=variant,
                batch=batch,
                seq_len=seq_len,
                device=str(device),
                tiny=tiny,
                max_batch=args.max_batch if device.type == "cuda" else "off",
                profile=args.profile,
                memory_peak=args.memory_peak,
                steps=args.steps,
                warmup=args.warmup,
            )
            print(f"[e2e] {shape.name} b{batch} | {variant} ...", file=sys.stderr, flush=True)
            if isolate:
                log = Path(args.out) / f"worker-{key}-{variant.replace('+', '-')}.log"
                result = _run_isolated(job, args.timeout, log)
            else:
                result = _run_in_process(job)
            row.update({k: v for k, v in result.items() if k != "shape"})
            print(f"[e2e] {shape.name} b{batch} | {variant} = {_brief(row)}", file=sys.stderr)
            rows.append(row)
            if on_row is not None:
                on_row(rows)
    return rows


def default_variants() -> tuple[str, ...]:
    """The variants run without --variants: DEFAULT_VARIANTS, and unsloth where it imports."""
    return DEFAULT_VARIANTS + (() if unsloth_variant.missing() else ("unsloth",))


def _not_run(variant: str, device: torch.device, isolate: bool) -> dict[str, str] | None:
    """The row's note (skipped on a CPU) or error (a missing peer) when the variant cannot run."""
    if variant == "unsloth" and unsloth_variant.missing():
        return {"error": unsloth_variant.missing()}
    if variant == "unsloth" and device.type == "cuda" and not isolate:
        # Unsloth patches transformers for the whole process: every later variant would run it.
        return {"error": "unsloth runs only in its own subprocess (drop --in-process)"}
    if device.type != "cuda" and variant in ("hf+peft+liger", "unsloth"):
        peer = "Liger-Kernel" if variant == "hf+peft+liger" else "Unsloth"
        return {"note": f"skipped: {peer} needs CUDA"}
    return None


def _brief(row: dict[str, Any]) -> str:
    if row.get("error"):
        return "ERROR " + row["error"]
    if "tokens_per_s" not in row:
        return row.get("note", "-")
    peak = row.get("peak_gib")
    memory = f", {peak:.2f} GiB" if peak is not None else ""
    return f"{row['tokens_per_s']:,.0f} tokens/s, {row['step_ms']:.1f} ms{memory}"


def format_e2e(rows: list[dict[str, Any]]) -> str:
    header = ("shape", "batch", "variant", "step ms", "tokens/s", "vs hf+peft", "peak GiB")
    header += ("largest batch", "note")
    baseline = {r["shape"]: r.get("tokens_per_s") for r in rows if r["variant"] == "hf+peft"}
    lines = []
    for r in rows:
        tps, base = r.get("tokens_per_s"), baseline.get(r["shape"])
        ratio = f"{tps / base:.2f}x" if tps and base else "-"
        lines.append(
            (
                r["shape"],
                str(r["batch"]),
                r["variant"],
                _fmt(r.get("step_ms"), ".1f"),
                _fmt(tps, ",.0f"),
                ratio,
                _fmt(r.get("peak_gib"), ".2f"),
                _largest(r),
                ("ERROR " + r["error"]) if r.get("error") else r.get("note", ""),
            )
        )
    widths = [max(len(x) for x in col) for col in zip(header, *lines, strict=True)]
    right = {1, 3, 4, 5, 6}

    def render(cells):
        pairs = enumerate(zip(cells, widths, strict=True))
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in pairs]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(header), rule, *(render(line) for line in lines)])


def _largest(row: dict[str, Any]) -> str:
    estimate = row.get("max_batch_estimate")
    if estimate is None:
        return "-"
    if "max_batch_verified" not in row:
        return f"~{estimate} (est.)"
    verified = row["max_batch_verified"]
    return f"{verified} (est. {estimate}, ran)" if verified is not None else f"<{estimate} (OOM)"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _versions() -> str:
    import importlib.metadata

    names = ("torch", "triton", "transformers", "peft", "liger-kernel", "unsloth", "fusetune")
    found = []
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name}={importlib.metadata.version(name)}")
    return " ".join(found)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fusetune bench e2e",
        description="One LoRA training step of Llama-3.2-1B- and Qwen2.5-0.5B-shaped models: "
        "HF + PEFT, + Liger-Kernel, + fusetune (tiny smoke run without a GPU).",
    )
    parser.add_argument(
        "--shapes",
        default=",".join(DEFAULT_SHAPES),
        help=f"of {', '.join(SHAPES)} (default: %(default)s)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(default_variants()),
        help=f"of {', '.join(VARIANTS)} (default: %(default)s)",
    )
    parser.add_argument("--batch", type=int, default=None, help="(default: 4 Llama, 8 Qwen)")
    parser.add_argument("--seq-len", type=int, default=None, help=f"(default: {SEQ_LEN})")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median; 5)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first (4)")
    parser.add_argument(
        "--max-batch",
        choices=("off", "estimate", "verify"),
        default="estimate",
        help="largest batch that fits: off, estimate (from the measured memory; free) or "
        "verify (also run it) (default: %(default)s)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny configs (smoke run)")
    parser.add_argument("--in-process", action="store_true", help="no subprocess per variant")
    parser.add_argument("--profile", action="store_true", help="CUDA time per kernel, one step")
    parser.add_argument("--memory-peak", action="store_true",
                        help="what one more step holds at its peak, by the frame that allocated "
                             "it (fusetune.bench.memory_peak)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=WORKER_TIMEOUT_S, help="per variant, s")
    parser.add_argument("--out", default="bench_results", help="folder for e2e.json and e2e.txt")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m fusetune bench e2e``: 0, or 1 when a fusetune variant failed."""
    args = build_parser().parse_args(argv)
    # PEFT calls a transformers property that 5.2x deprecates: noise in every variant's log.
    warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
    args.shapes = parse_choices(args.shapes, SHAPES, "--shapes")
    args.variants = parse_choices(args.variants, VARIANTS, "--variants")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device, quick=device.type != "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict[str, Any]]) -> None:
        (out / "e2e.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")

    rows = run_e2e(args, on_row=save)
    where = env["gpu"] or "CPU smoke run (tiny configs)"
    title = (
        f"e2e: one LoRA step (fwd + bwd + AdamW), r={RANK} on all linear layers, bf16 base, "
        f"fp32 adapters, sdpa | {where} | {_versions()} | {env['date']}"
    )
    profiles = [line for row in rows for line in profile_lines(row)]
    for row in rows:
        if row.get("memory_peak"):
            profiles += [f"memory {row['shape']} b{row['batch']} {row['variant']}:",
                         *row["memory_peak"]]  # fmt: skip
    text = "\n".join([format_e2e(rows), title, *profiles])
    print(text)
    save(rows)
    (out / "e2e.txt").write_text(text + "\n")
    print(f"wrote {out / 'e2e.json'} and {out / 'e2e.txt'}")
    failed = [r for r in rows if r["variant"] == "hf+peft+fusetune" and r.get("error")]
    return 1 if failed else 0


def profile_lines(row: dict[str, Any]) -> list[str]:
    profile = row.get("profile")
    if not profile:
        return []
    kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in profile["kinds_ms"].items())
    total = f"CUDA {sum(profile['kinds_ms'].values()):.1f} ms"
    if profile.get("wall_ms") is not None:  # the rest of the step is host time or gaps
        total += f" in a {profile['wall_ms']:.1f} ms step"
    lines = [f"profile {row['shape']} b{row['batch']} {row['variant']}: {total}; by kind: {kinds}"]
    if profile.get("syncs") is not None:
        waits = ", ".join(f"{name} x{count}" for name, count in profile["syncs"].items())
        lines.append(f"  host waits for the GPU: {waits or 'none'}")
    lines += [f"  {p['ms']:8.2f} {p['calls']:5d}  {p['kernel']}" for p in profile["top"]]
    return lines


def parse_choices(text: str, known, option: str) -> list[str]:
    picked = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [p for p in picked if p not in known]
    if unknown or not picked:
        raise SystemExit(f"error: {option}: unknown {unknown or text!r}; known: {', '.join(known)}")
    return picked


# ----------------------------------------------------------------------------- harness cases


def _harness_make(key: str) -> Callable[[torch.device, bool], dict[str, Callable[[], object]]]:
    """Providers for the generic harness. Each model is built with one step already taken (so
    its AdamW state exists and the harness's peak is the step's, above weights and optimizer
    state); HF + PEFT now, fusetune at its first call, which drops the HF + PEFT model first
    (fusetune's RoPE patch is family-wide while a patched model lives, and two models need not
    share the memory)."""

    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        shape = SHAPES[key]
        tiny = device.type != "cuda"
        batch, seq_len = (TINY_BATCH, TINY_SEQ_LEN) if tiny else (shape.batch, SEQ_LEN)
        live: dict[str, Callable[[], torch.Tensor]] = {}

        def start(variant: str) -> None:
            live.clear()
            gc.collect()
            model = build(shape, variant, device, tiny)
            step = make_step(model, _ids(batch, seq_len, model.config.vocab_size, device))
            step()
            live[variant] = step

        def provider(variant: str) -> Callable[[], object]:
            def step() -> object:
                if variant not in live:
                    start(variant)
                return live[variant]()

            return step

        start("hf+peft")
        return {"hf+peft": provider("hf+peft"), "fusetune": provider("hf+peft+fusetune")}

    return make


def _harness_flops(key: str) -> Callable[[bool], float]:
    def floor(quick: bool) -> float:
        return flops(SHAPES[key], SHAPES[key].batch, SEQ_LEN)

    return floor


for _key in DEFAULT_SHAPES:
    _shape = SHAPES[_key]
    register(
        Case(
            op="e2e",
            name=f"{_shape.name} LoRA step b{_shape.batch} s{SEQ_LEN}",
            make=_harness_make(_key),
            floor_flops=_harness_flops(_key),
        )
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2]))
    sys.exit(main(sys.argv[1:]))
