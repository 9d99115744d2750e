"""fusetune.apply under transformers' Trainer: with gradient accumulation (Trainer passes
num_items_in_batch to the patched forward) and gradient checkpointing, the logged losses and
the parameter updates match an unpatched Trainer run. CPU: fp32. GPU: also bf16=True
(autocast) and fp16=True (autocast + GradScaler), full fine-tuning and PEFT LoRA."""

from __future__ import annotations

import copy

import pytest
import torch

import fusetune
from harness import ON_GPU, assert_close
from test_transformers import (
    ADAM_EPS,
    FP32_LOSS_TOL,
    FP32_UPDATE_TOL,
    LR,
    assert_as_close_as_transformers,
    lora_model,
    make_batches,
    tiny_model,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

STEPS = 12 if ON_GPU else 2
MICRO_BATCH, ACCUMULATE = 2, 2


def examples(steps: int) -> list[dict[str, torch.Tensor]]:
    rows = MICRO_BATCH * ACCUMULATE * steps
    ids, labels = (t.cpu() for t in make_batches(1, batch=rows)[0])
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(rows)]


def trainer_run(model, tmp_path, precision: str = "fp32", patch: bool = False):
    """Trains ``model`` for STEPS optimizer steps; returns (logged losses, updates by name)."""
    if patch:
        fusetune.apply(model)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in trainable.items()}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        max_steps=STEPS,
        learning_rate=LR,
        adam_epsilon=ADAM_EPS,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=not ON_GPU,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=examples(STEPS))
    # the patched forward keeps **kwargs in its signature: Trainer passes num_items_in_batch
    assert trainer.model_accepts_loss_kwargs
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == STEPS
    updates = {n: (p.detach() - start[n]).float() for n, p in trainable.items()}
    if patch:
        fusetune.revert(model)
    return torch.tensor(losses), updates


def build(kind: str):
    layers = 2 if ON_GPU else 1  # the interpreter's time goes to the checkpointed recompute
    maker = lora_model if kind == "lora" else tiny_model
    return maker("llama", num_hidden_layers=layers)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_trainer_fp32_accumulation_and_checkpointing(kind, tmp_path):
    model = build(kind)
    want = trainer_run(copy.deepcopy(model), tmp_path)
    got = trainer_run(model, tmp_path, patch=True)
    assert_close("logged losses", got[0], want[0], FP32_LOSS_TOL)
    for name, update in want[1].items():
        assert_close(f"update of {name}", got[1][name], update, FP32_UPDATE_TOL)


@pytest.mark.skipif(not ON_GPU, reason="Trainer's bf16 / fp16 modes need a GPU (GPU pass)")
@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trainer_mixed_precision_as_close_as_transformers(precision, kind, tmp_path):
    """bf16=True / fp16=True (GradScaler): patched and unpatched runs each compared with the
    fp32 run; fusetune's distance within 1.5x transformers' (+ a small floor)."""
    model = build(kind)
    exact = trainer_run(copy.deepcopy(model), tmp_path)
    want = trainer_run(copy.deepcopy(model), tmp_path, precision)
    got = trainer_run(model, tmp_path, precision, patch=True)
    assert_as_close_as_transformers(got, want, exact)
