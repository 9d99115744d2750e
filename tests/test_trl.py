"""fusetune.apply under TRL's SFTTrainer.

TRL (1.x) computes the SFT loss with its own fused LM head: it calls the model with
``fused_lm_head=True``, runs the backbone, then scores the labelled positions in tiles (log-probs,
entropy, token accuracy), no logits materialised. So under TRL fusetune routes the backbone (norms,
RoPE, the gated MLP, PEFT LoRA) and TRL the head. In fp32 the logged losses, TRL's entropy and
token-accuracy metrics and the parameter updates match an unpatched run. CI installs TRL; the
GPU machine has none (the module skips there), and what this checks is the seam, not the
kernels, which the transformers tests run on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch

import fusetune
from fusetune.integrations import peft as peft_integration
from harness import ON_GPU, assert_close
from test_transformers import (
    ADAM_EPS,
    FP32_LOSS_TOL,
    FP32_UPDATE_TOL,
    LR,
    counting,
    fused_calls,  # noqa: F401 (a fixture)
    lora_model,
    make_batches,
    tiny_model,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*gradient_checkpointing.*:FutureWarning", "ignore::UserWarning"
)

STEPS, BATCH = 3, 2
METRICS = ("loss", "entropy", "mean_token_accuracy")


def word_tokenizer(vocab_size: int):
    """A tokenizer whose token i is the word ``t{i}``: TRL wants one (padding, EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="t1", eos_token="t2"
    )


def sft_run(model, tmp_path, patch: bool | str):
    """STEPS SFT steps in fp32 on pre-tokenized rows; (metrics per step, updates by name).
    ``patch``: True applies fusetune to the model before the trainer exists (the backbone only:
    TRL's head scores the tokens), "trainer" to the trainer (the backbone and TRL's head)."""
    if patch is True:
        fusetune.apply(model)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in trainable.items()}
    ids, _ = make_batches(1, batch=STEPS * BATCH)[0]
    rows = datasets.Dataset.from_list([{"input_ids": row.tolist()} for row in ids.cpu()])
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=LR,
        adam_epsilon=ADAM_EPS,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        bf16=False,  # SFTConfig's default is bf16
        use_cpu=not ON_GPU,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = sft_trainer(model, args, rows)
    if patch == "trainer":
        fusetune.apply(trainer)
    try:
        trainer.train()
    finally:
        if patch:
            fusetune.revert(trainer if patch == "trainer" else model)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == STEPS
    metrics = {name: torch.tensor([entry[name] for entry in logged]) for name in METRICS}
    updates = {n: (p.detach() - start[n]).float() for n, p in trainable.items()}
    return metrics, updates


def sft_trainer(model, args, rows):
    tokenizer = word_tokenizer(model.config.vocab_size)
    return trl.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)


def test_patched_trainer_leaves_another_models_head_to_trl(tmp_path):
    """TRL's head function is module-wide: while one trainer is patched, a model of another
    (TRL's fused forward, unpatched) keeps TRL's own kernel; the patched one gets fusetune's."""
    from trl.trainer.utils import add_fused_lm_head

    from fusetune.integrations import trl as trl_integration

    other = tiny_model("llama", num_hidden_layers=1)
    add_fused_lm_head(other)
    model = tiny_model("llama", num_hidden_layers=1)
    rows = datasets.Dataset.from_list([{"input_ids": list(range(3, 11))}])
    args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=not ON_GPU, bf16=False,
                         report_to="none", max_steps=1)  # fmt: skip
    trainer = fusetune.apply(sft_trainer(model, args, rows))
    ids, _ = make_batches(1)[0]
    try:
        calls = trl_integration.FusedHead.calls
        theirs = other(input_ids=ids, labels=ids, fused_lm_head=True).loss
        assert trl_integration.FusedHead.calls == calls
        ours = trainer.model(input_ids=ids, labels=ids, fused_lm_head=True).loss
        assert trl_integration.FusedHead.calls == calls + 1
    finally:
        fusetune.revert(trainer)
    other_again = other(input_ids=ids, labels=ids, fused_lm_head=True).loss
    assert torch.equal(theirs, other_again)  # the very kernel TRL runs unpatched
    assert torch.isfinite(ours)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_sft_trainer_matches_an_unpatched_run(kind, tmp_path, fused_calls, monkeypatch):  # noqa: F811
    maker = lora_model if kind == "lora" else tiny_model
    model = maker("llama", num_hidden_layers=1)
    for name in ("lora_qkv_validated", "lora_mlp_validated"):  # the PEFT LoRA route's fused ops
        counted = counting(fused_calls, name, getattr(peft_integration, name))
        monkeypatch.setattr(peft_integration, name, counted)
    want = sft_run(copy.deepcopy(model), tmp_path, patch=False)
    assert not any(fused_calls.values())
    got = sft_run(model, tmp_path, patch=True)
    for name in METRICS:
        assert_close(f"logged {name}", got[0][name], want[0][name], FP32_LOSS_TOL, atol=1e-7)
    for name, update in want[1].items():
        assert_close(f"update of {name}", got[1][name], update, FP32_UPDATE_TOL)
    mlp = "lora_mlp_validated" if kind == "lora" else "glu_linear"  # full: glu + down_proj
    assert fused_calls["rms_norm"] and fused_calls["rope"] and fused_calls[mlp], fused_calls
    # one fused q/k/v per attention forward with LoRA: one layer, so as many as RoPE calls
    # (SFTConfig checkpoints by default: the backward's recompute calls both again)
    qkv_calls = fused_calls["rope"] if kind == "lora" else 0
    assert fused_calls["lora_qkv_validated"] == qkv_calls, fused_calls
    # TRL's own head computes the loss; ours would show here if TRL handed the labels on.
    assert fused_calls["linear_cross_entropy"] == 0, fused_calls


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_sft_trainer_with_fusetune_head_matches(kind, tmp_path):
    """fusetune.apply(trainer): TRL's head (loss, entropy, token accuracy) comes from fusetune's
    kernels; the logged metrics and updates are TRL's own in fp32."""
    from fusetune.integrations import trl as trl_integration

    maker = lora_model if kind == "lora" else tiny_model
    model = maker("llama", num_hidden_layers=1)
    want = sft_run(copy.deepcopy(model), tmp_path, patch=False)
    calls = trl_integration.FusedHead.calls
    got = sft_run(model, tmp_path, patch="trainer")
    assert trl_integration.FusedHead.calls > calls
    for name in METRICS:
        assert_close(f"logged {name}", got[0][name], want[0][name], FP32_LOSS_TOL, atol=1e-7)
    for name, update in want[1].items():
        assert_close(f"update of {name}", got[1][name], update, FP32_UPDATE_TOL)
