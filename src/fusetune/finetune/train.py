"""The supervised fine-tuning loop: AdamW with a learning-rate schedule, gradient accumulation
with HF's ``num_items_in_batch`` (the accumulated loss equals one big batch's), optional loss
scaling, gradient clipping, checkpoints (every N steps and on SIGINT / SIGTERM), a stop (or a
counted skip) on a non-finite loss or gradient. One host sync per optimizer step: the loss, the
gradient norm and the stop flag together, before the update (so a bad step never updates)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fusetune.finetune import schedule
from fusetune.finetune.checkpoint import Checkpointing
from fusetune.finetune.data import Batch
from fusetune.finetune.distributed import Ranks, all_sum, pin_main_thread
from fusetune.finetune.errors import FinetuneError, Interrupted, RunStopped
from fusetune.finetune.interrupt import StopRequests
from fusetune.finetune.precision import Precision
from fusetune.finetune.progress import ProgressBar, format_memory, peak_memory
from fusetune.integrations.fsdp import average_gradients

# Steps left out of the throughput: the first one compiles and autotunes kernels.
WARMUP_STEPS = 1
# --cuda-graph: eager steps before the capture (lazy initialisation, autotuning, AdamW's state).
GRAPH_WARMUP_STEPS = 2


@dataclass
class RunResult:
    """What one run measured. ``tokens_per_s`` leaves out the first step when there are 3 or
    more (kernel compilation), and under torch.compile every step during which a graph was
    compiled (``untimed`` counts the steps left out); ``peak_memory`` is the CUDA allocator's
    peak over the whole run, model and optimizer state included (on the CPU: the process's
    peak RSS)."""

    label: str
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    timed_tokens: int = 0
    timed_seconds: float = 0.0
    seconds: float = 0.0
    peak_memory: int | None = None
    memory_kind: str = ""
    skipped: list[int] = field(default_factory=list)  # 1-based steps skipped (not finite)
    untimed: int = 0  # steps left out of tokens_per_s (warm-up, compiling)
    resumed_from: int = 0  # the checkpoint's step, 0: started at step 1

    @property
    def tokens_per_s(self) -> float:
        return self.timed_tokens / self.timed_seconds if self.timed_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "losses": [v if math.isfinite(v) else None for v in self.losses],
            "skipped_steps": self.skipped,
            "resumed_from_step": self.resumed_from,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s,
            "untimed_steps": self.untimed,
            "seconds": self.seconds,
            "peak_memory_bytes": self.peak_memory,
            "memory_kind": self.memory_kind,
        }


@dataclass(frozen=True)
class TrainSettings:
    lr: float
    max_grad_norm: float
    precision: Precision
    device: torch.device
    ranks: Ranks = Ranks()
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    skip_nonfinite: bool = False
    compiled: bool = False  # torch.compile'd: steps that compile are left out of tokens/s
    cuda_graph: bool = False  # steps replayed from CUDA graphs (_StepGraphs)
    replicated: bool = False  # every rank holds the whole model: gradients averaged here
    pin_cpu: bool = False  # the main thread pinned to a core after the first step


@dataclass
class _State:
    """What one run trains: the parameters (named, for fault messages), optimizer, scaler."""

    model: torch.nn.Module
    named: list[tuple[str, torch.nn.Parameter]]
    optimizer: torch.optim.Optimizer
    scaler: Any

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named]


def train(
    model: torch.nn.Module,
    steps: list[list[Batch]],
    settings: TrainSettings,
    label: str,
    progress: ProgressBar | None = None,
    checkpoints: Checkpointing | None = None,
) -> RunResult:
    """Run one optimizer step per entry of ``steps`` (each a list of micro-batches), from the
    checkpoint ``checkpoints`` resumes, writing the ones it asks for.

    Raises RunStopped on a non-finite loss or gradient (unless ``settings.skip_nonfinite``),
    Interrupted after SIGINT / SIGTERM (a checkpoint written first, when ``checkpoints``)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    device = settings.device
    graphed = settings.cuda_graph  # (a graph reads the rate from a tensor: schedules fill it)
    lr = torch.tensor(settings.lr, device=device) if graphed else settings.lr
    optimizer = torch.optim.AdamW(
        [p for _, p in named], lr=lr, weight_decay=0.0, fused=device.type == "cuda",
        capturable=graphed,
    )  # fmt: skip
    scaler = torch.amp.GradScaler(device.type) if settings.precision.grad_scaler else None
    state = _State(model, named, optimizer, scaler)
    result = RunResult(label)
    first = checkpoints.start(model, optimizer, scaler, result) if checkpoints else 0
    model.train()
    skip = first + (WARMUP_STEPS if len(steps) - first >= 3 else 0)
    if graphed:  # the eager steps and the capture
        skip = first + GRAPH_WARMUP_STEPS + 1
    step_graphs: _StepGraphs | None = None
    unpinned = None  # (the CPU mask to restore when pinned)
    start = time.perf_counter()
    try:
        with StopRequests() as requests:
            for index in range(first, len(steps)):
                step_start = time.perf_counter()
                factor = schedule.lr_factor(
                    index, len(steps), settings.lr_schedule, settings.warmup_steps
                )
                schedule.set_lr(optimizer, settings.lr, factor)
                graphs = _compiled_graphs() if settings.compiled else 0
                if graphed and index >= first + GRAPH_WARMUP_STEPS:
                    step_graphs = step_graphs or _StepGraphs(state, steps[index], settings)
                    loss, fault, stop = step_graphs.step(state, steps[index], requests.signum)
                else:
                    loss, fault, stop = _step(state, steps[index], settings, requests.signum)
                timed = index >= skip and (not settings.compiled or _compiled_graphs() == graphs)
                if fault is not None:
                    _on_fault(index + 1, fault, settings, checkpoints, result)
                seconds = time.perf_counter() - step_start
                tokens = _record(result, steps[index], loss, seconds, timed, device)
                if progress is not None:
                    rate = result.tokens_per_s or tokens / max(seconds, 1e-9)
                    memory = format_memory(result.peak_memory, result.memory_kind)
                    progress.update(index + 1, loss, rate, memory, time.perf_counter() - start)
                done = index + 1
                if settings.pin_cpu and index == first:
                    unpinned = pin_main_thread(settings.ranks)
                stop = stop or (settings.ranks.world == 1 and requests.signum > 0)
                if checkpoints is not None and (stop or checkpoints.due(done)):
                    checkpoints.save(done, model, optimizer, scaler, result)
                if stop:
                    _interrupted(requests.signum or int(signal.SIGTERM), done, checkpoints)
    finally:
        if progress is not None:
            progress.close()
        if unpinned is not None:  # (--compare's second run compiles with the whole mask)
            os.sched_setaffinity(0, unpinned)
    result.seconds = time.perf_counter() - start
    return result


def _record(result: RunResult, micro_batches, loss: float, seconds, timed, device) -> int:
    tokens = sum(batch.tokens for batch in micro_batches)
    result.losses.append(loss)
    result.tokens += tokens
    if timed:
        result.timed_tokens += tokens
        result.timed_seconds += seconds
    else:
        result.untimed += 1
    result.peak_memory, result.memory_kind = peak_memory(device)
    return tokens


def _compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far (recompiles too)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _on_fault(step: int, fault: str, settings, checkpoints, result: RunResult) -> None:
    if settings.skip_nonfinite:
        result.skipped.append(step)
        return
    last = checkpoints.last_good if checkpoints is not None else None
    where = (
        f"the last good checkpoint is {last} (--resume {last} continues from it; "
        "--skip-nonfinite skips such steps)"
        if last is not None
        else "no checkpoint was written before it (--save-every N writes them)"
    )
    raise RunStopped(f"step {step}: the {fault} is not finite; stopped; {where}")


def _interrupted(signum: int, step: int, checkpoints) -> None:
    name = signal.Signals(signum).name
    if checkpoints is not None:
        saved = f"checkpoint written: {checkpoints.last_good} (--resume continues from it)"
    else:
        saved = "no checkpoint written"
    raise Interrupted(f"{name} after step {step}: {saved}", signum)


def _autocast(precision: Precision, device: torch.device, cache: bool = True):
    if not precision.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision.compute_dtype, cache_enabled=cache)


def _step(
    state: _State, micro_batches, settings: TrainSettings, signum: int
) -> tuple[float, str | None, bool]:
    """One optimizer step: (the loss, what was not finite or None, whether any rank was asked
    to stop). A step with a non-finite loss or gradient does not update the weights."""
    device, precision = settings.device, settings.precision
    model, optimizer, scaler = state.model, state.optimizer, state.scaler
    # The loss of every micro-batch is its sum over tokens / the step's token count, so the
    # accumulated gradient is that of the mean over the whole step, however tokens fall.
    ranks = settings.ranks
    items = torch.tensor(sum(b.label_count for b in micro_batches), device=device)
    items = all_sum(items, ranks)  # the step's labelled tokens over every rank
    total = torch.zeros((), device=device)
    for batch in micro_batches:
        with _autocast(precision, device):
            output = model(
                input_ids=batch.input_ids.to(device, non_blocking=True),
                attention_mask=batch.attention_mask.to(device, non_blocking=True),
                labels=batch.labels.to(device, non_blocking=True),
                num_items_in_batch=items,
            )
        loss = output.loss
        scaled = loss * ranks.world  # gradients are averaged over ranks: sum them instead
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        total += loss.detach().float()
    if settings.replicated:  # (only on several ranks)
        average_gradients(state.params)
    # the stop flag rides with the loss: every rank learns that one was signalled
    flag = torch.full((), float(signum > 0), device=device)  # a fill: no host-to-device copy
    packed = all_sum(torch.stack([total, flag]), ranks)
    if scaler is not None:
        scaler.unscale_(optimizer)
    grads = [p.grad for p in state.params if p.grad is not None]
    norm = _total_norm(grads)  # what clip_grad_norm_ computes; clipped below, once it is known
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
    values = torch.stack([packed[0], full.to(packed.dtype).reshape(()), packed[1]])
    loss_value, norm_value, stop = values.tolist()  # sync
    fault = _fault(loss_value, norm_value, state, ranks)
    if fault is None:
        if settings.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(state.params, settings.max_grad_norm, norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, fault, stop > 0


def _fault(loss: float, norm: float, state: _State, ranks: Ranks) -> str | None:
    """What was not finite this step (None: nothing). fp16's scaler skips its own overflows."""
    if not math.isfinite(loss):
        return "loss"
    if state.scaler is None and not math.isfinite(norm):
        return f"gradient of {_nonfinite_gradient(state.named, ranks)}"
    return None


class _StepGraphs:
    """--cuda-graph: a step as CUDA graphs: ``first``, forward and backward of the step's first
    micro-batch; ``more``, the same for each further micro-batch (--grad-accum); ``norm``, the
    gradients' norm; ``update``, clipping and the AdamW update. Between ``norm`` and ``update``
    the host reads the loss and the norm, as ``_step`` does, so a bad step still never updates.
    The graphs own the gradients, so nothing zeroes them: ``first`` writes them afresh, ``more``
    adds to them. On several ranks the model is replicated (``--replicate``): ``norm`` first
    averages the gradients (NCCL inside the graph), and the step's token count, loss and stop
    flag are summed over the ranks around the replays, outside the graphs. No loss scaling (the
    command refuses the rest). Batches have one shape and go in without their attention mask:
    rows are right-padded, so under the causal mask no real token sees a pad, and pads carry no
    label (the loss is the masked run's)."""

    def __init__(self, state: _State, micro_batches: list[Batch], settings: TrainSettings) -> None:
        device = settings.device
        self.input_ids = micro_batches[0].input_ids.to(device)
        self.labels = micro_batches[0].labels.to(device)
        self.items = torch.zeros((), dtype=torch.long, device=device)
        # [the step's loss, the stop flag] (summed over ranks), then the gradients' norm
        self.values = torch.zeros(3, device=device)
        self.ranks = settings.ranks
        torch.cuda.synchronize(device)
        # captured with no gradients, `first` allocates them from its pool and keeps them; each
        # replay then writes them afresh, and `more`, captured with them there, adds to them
        state.optimizer.zero_grad(set_to_none=True)
        try:
            self.first, self.more, self.norm, self.update = self._capture(
                state, settings, accumulates=len(micro_batches) > 1
            )
        except RuntimeError as exc:  # a host sync or CPU copy in the model's step: say which
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise FinetuneError(
                f"--cuda-graph: the step cannot be captured as a CUDA graph ({first}); "
                "run without --cuda-graph"
            ) from exc

    def _capture(self, state: _State, settings: TrainSettings, accumulates: bool) -> tuple:
        from fusetune.graphed_step import capture

        first, _ = capture(lambda: self._micro_batch(state, settings, accumulate=False))
        more = None
        if accumulates:
            # in first's pool, so that the activations take memory once: safe, as `more` keeps
            # no tensor of its own for anything to read after its replay
            more, _ = capture(
                lambda: self._micro_batch(state, settings, accumulate=True), first.pool()
            )
        norm, _ = capture(lambda: self._norm(state, settings.replicated))
        update, _ = capture(lambda: self._update(state, settings.max_grad_norm))
        return first, more, norm, update

    def _micro_batch(self, state: _State, settings: TrainSettings, accumulate: bool) -> None:
        # (no autocast cast cache: cached casts would outlive the captured region)
        with _autocast(settings.precision, settings.device, cache=False):
            output = state.model(
                input_ids=self.input_ids, labels=self.labels, num_items_in_batch=self.items
            )
        world = self.ranks.world  # gradients are averaged over ranks (_norm): sum them instead
        (output.loss * world if world > 1 else output.loss).backward()
        loss = output.loss.detach()
        if accumulate:
            self.values[0].add_(loss)
        else:
            self.values[0].copy_(loss)

    def _norm(self, state: _State, replicated: bool) -> None:
        if replicated:
            average_gradients(state.params)
        self.values[2].copy_(_total_norm([p.grad for p in state.params if p.grad is not None]))

    def _update(self, state: _State, max_grad_norm: float) -> None:
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(state.params, max_grad_norm, self.values[2])
        state.optimizer.step()

    def step(self, state: _State, micro_batches, signum: int) -> tuple[float, str | None, bool]:
        """As ``_step``: (the loss, what was not finite or None, whether to stop)."""
        # each micro-batch's loss is over the step's labelled tokens: the step mean's gradient
        self.items.fill_(sum(batch.label_count for batch in micro_batches))  # (no H2D copy)
        all_sum(self.items, self.ranks)  # (in place; the replays wait for it on the GPU)
        graphs = [self.first] + [self.more] * (len(micro_batches) - 1)
        for graph, batch in zip(graphs, micro_batches, strict=True):
            self.input_ids.copy_(batch.input_ids, non_blocking=True)
            self.labels.copy_(batch.labels, non_blocking=True)
            graph.replay()
        self.values[1].fill_(float(signum > 0))  # every rank learns that one was signalled
        self.norm.replay()
        all_sum(self.values[:2], self.ranks)
        loss_value, stop, norm_value = self.values.tolist()  # sync
        fault = _fault(loss_value, norm_value, state, self.ranks)
        if fault is None:
            self.update.replay()
        return loss_value, fault, stop > 0


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over every gradient (clip_grad_norm_'s): not finite iff an element is not."""
    return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())


def _nonfinite_gradient(named: list[tuple[str, torch.nn.Parameter]], ranks: Ranks) -> str:
    """The first parameter whose gradient holds a NaN or inf (a flag per parameter summed over
    ranks, so each rank's shard counts); only on the faulty step."""
    flags = []
    for _, param in named:
        grad = param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        bad = local is not None and not bool(torch.isfinite(local).all())
        flags.append(float(bad))
    found = all_sum(torch.tensor(flags, device=named[0][1].device), ranks)
    for (name, _), flag in zip(named, found.tolist(), strict=True):
        if flag > 0:
            return name
    return "a parameter"
