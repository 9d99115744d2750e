"""fusetune.apply(trainer) under TRL's GRPOTrainer against unpatched TRL on the same prompts,
seeds and rewards: per-step loss, every logged metric and the parameter updates in fp32.

The head-only runs (``fusetune.apply(trainer, rms_norm=False, ...)``) leave generation exactly
transformers' own, so both runs sample the same completions and every difference is the head's:
they cover every loss type, both importance-sampling levels, the KL with a reference model and
with PEFT's disabled-adapter reference, temperature, several iterations per generation with
gradient accumulation, the entropy mask and bonus, the off-policy sequence mask and truncated
completions masked out. The full-apply runs (backbone too) check that the whole model trains
through fusetune. A spy counts the head calls fusetune served.

fusetune serves TRL's head and leaves its loss code alone, so every GRPO option runs TRL's own
path on fusetune's log-probs and entropy: none falls back, and none warns. The vLLM
importance-sampling correction (its inputs come from vLLM, absent on the CPU) is checked at the
loss: the same hand-made batch through ``compute_loss``. bf16: fusetune's run is as far from
TRL's fp32 run as TRL's own bf16 run is."""

from __future__ import annotations

import copy

import pytest
import torch

import fusetune
from fusetune.integrations import trl as trl_integration
from harness import ON_GPU, assert_close
from test_transformers import ADAM_EPS, FP32_LOSS_TOL, FP32_UPDATE_TOL, lora_model, tiny_model
from test_trl import word_tokenizer

peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

STEPS = 2
HEAD_ONLY = dict(rms_norm=False, rope=False, mlp=False, lora=False)
# timings and counters that differ between any two runs
UNCOMPARED = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
UNCOMPARED += ("total_flos", "epoch", "step", "num_tokens", "grad_norm", "learning_rate")


def even_words(completions, **kwargs):
    """A deterministic reward: the share of words ``t<even id>`` in the completion."""
    rewards = []
    for text in completions:
        words = text.split() or ["t1"]
        rewards.append(sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / len(words))
    return rewards


def make_trainer(model, tmp_path, **config):
    """A GRPOTrainer on 8 prompts with the even_words reward, in fp32 unless ``config`` says
    bf16. With beta > 0 and no PEFT, TRL loads the reference model from the policy's name: a
    copy of the initial weights saved under tmp_path."""
    if config.get("beta", 0.0) > 0 and not isinstance(model, peft.PeftModel):
        saved = tmp_path / "reference"
        if not saved.exists():
            model.save_pretrained(saved)
        model.config._name_or_path = str(saved)
    prompts = datasets.Dataset.from_list([{"prompt": f"t{3 + i} t{9 + i}"} for i in range(8)])
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=5, max_steps=STEPS, learning_rate=1e-3, adam_epsilon=ADAM_EPS,
        lr_scheduler_type="constant", weight_decay=0.0, bf16=False, use_cpu=not ON_GPU,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        shuffle_dataset=False,
    )  # fmt: skip
    settings.update(config)
    args = trl.GRPOConfig(**settings)
    if ON_GPU:  # on a host of several GPUs one process trains on the first (Trainer's own
        _ = args.device  # way for a split model), not in nn.DataParallel, which TRL refuses
        args._n_gpu = 1
    return trl.GRPOTrainer(
        model=model, reward_funcs=[even_words], args=args,
        train_dataset=prompts, processing_class=word_tokenizer(model.config.vocab_size),
    )  # fmt: skip


def grpo_run(model, tmp_path, apply_options, **config):
    """STEPS GRPO steps; (logged metrics per step, parameter updates, head calls)."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in trainable.items()}
    trainer = make_trainer(model, tmp_path, **config)
    calls = trl_integration.FusedHead.calls
    if apply_options is not None:
        fusetune.apply(trainer, **apply_options)
    try:
        trainer.train()
    finally:
        if apply_options is not None:
            fusetune.revert(trainer)
    calls = trl_integration.FusedHead.calls - calls
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == STEPS, trainer.state.log_history
    names = [k for k in logged[0] if k not in UNCOMPARED]
    names = [k for k in names if all(isinstance(e.get(k), float | int) for e in logged)]
    metrics = {k: torch.tensor([e[k] for e in logged], dtype=torch.float64) for k in names}
    updates = {n: (p.detach() - start[n]).float() for n, p in trainable.items()}
    return metrics, updates, calls


def compare(want, got, metric_tol=FP32_LOSS_TOL):
    assert got[0].keys() == want[0].keys()
    for name, values in want[0].items():
        assert_close(f"logged {name}", got[0][name], values, metric_tol, atol=1e-6)
    for name, update in want[1].items():
        assert_close(f"update of {name}", got[1][name], update, FP32_UPDATE_TOL, atol=1e-7)


CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo-beta": dict(loss_type="bnpo", beta=0.05),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo-temperature": dict(loss_type="dapo", temperature=0.7),
    "cispo": dict(loss_type="cispo"),
    "sapo": dict(loss_type="sapo"),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "grpo-sequence-delta": dict(loss_type="grpo", importance_sampling_level="sequence", delta=1.5),
    "vespo": dict(loss_type="vespo"),
    "iterations-accumulation": dict(loss_type="dapo", num_iterations=2, steps_per_generation=2,
                                    gradient_accumulation_steps=2, per_device_train_batch_size=2),
    "entropy-mask-bonus": dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.01,
                               mask_truncated_completions=True),
    # the second step reuses the first one's completions: old log-probs differ, and the mask
    # drops a negative-advantage sequence there (test_off_policy_mask_drops_sequences)
    "off-policy-mask": dict(loss_type="dapo", num_iterations=2, off_policy_mask_threshold=1e-4),
    "top-entropy-quantile": dict(loss_type="grpo", top_entropy_quantile=0.2),
    # the first step has a terminated completion, the second none (loss 0)
    "mask-truncated": dict(loss_type="bnpo", mask_truncated_completions=True),
    "adaptive-entropy": dict(loss_type="dapo", entropy_coef=0.01, use_adaptive_entropy=True,
                             entropy_target=5.0),
}  # fmt: skip


# "off-policy-mask" runs in test_off_policy_mask_drops_sequences, with the same checks
@pytest.mark.parametrize("case", [case for case in CASES if case != "off-policy-mask"])
def test_grpo_head_matches_trl(case, tmp_path):
    """fusetune's head under every GRPO option: TRL's own numbers in fp32."""
    model = tiny_model("llama", num_hidden_layers=1)
    want = grpo_run(copy.deepcopy(model), tmp_path, None, **CASES[case])
    got = grpo_run(model, tmp_path, HEAD_ONLY, **CASES[case])
    assert want[2] == 0 and got[2] > 0, (want[2], got[2])
    compare(want, got)


def test_grpo_lora_with_disabled_adapter_reference(tmp_path):
    """A PEFT policy with beta > 0: the reference log-probs come from the same model with its
    adapter disabled, through the same (fusetune) head."""
    model = lora_model("llama", num_hidden_layers=1)
    want = grpo_run(copy.deepcopy(model), tmp_path, None, beta=0.1)
    got = grpo_run(model, tmp_path, HEAD_ONLY, beta=0.1)
    assert got[2] > 0
    compare(want, got)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_grpo_full_apply_trains(kind, tmp_path):
    """fusetune.apply(trainer) with every part on: the backbone and the head. Generation now
    runs fusetune's kernels too, so sampling could in principle diverge; the completions are
    short and the logits agree to ~1e-7, and the run must match TRL's."""
    maker = lora_model if kind == "lora" else tiny_model
    model = maker("llama", num_hidden_layers=1)
    want = grpo_run(copy.deepcopy(model), tmp_path, None, beta=0.05)
    got = grpo_run(model, tmp_path, {}, beta=0.05)
    assert got[2] > 0
    compare(want, got)


def test_off_policy_mask_drops_sequences(tmp_path, monkeypatch):
    """test_grpo_head_matches_trl's off-policy case, its mask watched: fusetune's head matches
    TRL's own numbers in fp32, and the case is not vacuous: the mask drops a sequence, the same
    one in both runs."""
    masks = []
    original = trl.GRPOTrainer.get_off_policy_mask

    def spy(*args, **kwargs):
        masks.append(original(*args, **kwargs))
        return masks[-1]

    monkeypatch.setattr(trl.GRPOTrainer, "get_off_policy_mask", staticmethod(spy))
    model = tiny_model("llama", num_hidden_layers=1)
    config = CASES["off-policy-mask"]
    want_run = grpo_run(copy.deepcopy(model), tmp_path, None, **config)
    want, masks = masks, []
    got_run = grpo_run(model, tmp_path, HEAD_ONLY, **config)
    assert want_run[2] == 0 and got_run[2] > 0, (want_run[2], got_run[2])
    compare(want_run, got_run)
    assert len(masks) == len(want) == STEPS
    assert not want[-1].all() and all(torch.equal(a, b) for a, b in zip(masks, want, strict=True))


def vllm_batch(vocab: int, seed: int = 0) -> dict:
    """A scored batch as TRL's generation step hands it to compute_loss with vLLM: completions,
    advantages of both signs, old log-probs, the sampler's log-probs and their IS ratios."""
    generator = torch.Generator().manual_seed(seed)
    batch, prompt, completion = 4, 3, 5
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    completion_mask[1, 3:] = 0
    old = -torch.rand(batch, completion, generator=generator) * 4 - 1
    sampling = old + torch.randn(batch, completion, generator=generator) * 0.05
    return dict(
        prompt_ids=torch.randint(3, vocab, (batch, prompt), generator=generator),
        prompt_mask=torch.ones(batch, prompt, dtype=torch.long),
        completion_ids=torch.randint(3, vocab, (batch, completion), generator=generator),
        completion_mask=completion_mask,
        advantages=torch.tensor([0.8, -0.5, 1.2, -1.0]),
        old_per_token_logps=old,
        sampling_per_token_logps=sampling,
        importance_sampling_ratio=torch.exp(old - sampling).clamp(max=2.0),
        num_items_in_batch=completion_mask.sum(),
    )


def loss_and_grads(model, tmp_path, patched, **config):
    """compute_loss of vllm_batch with TRL's vLLM correction on: (loss, metrics, grads)."""
    trainer = make_trainer(model, tmp_path, **config)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer.current_gradient_accumulation_steps = 1
    if patched:
        fusetune.apply(trainer, **HEAD_ONLY)
    try:
        batch = vllm_batch(model.config.vocab_size)
        loss = trainer.compute_loss(
            trainer.model, {k: v.to(model.device) for k, v in batch.items()}
        )
        loss.backward()
    finally:
        if patched:
            fusetune.revert(trainer)
    metrics = {
        k: torch.tensor(v, dtype=torch.float64) for k, v in trainer._metrics["train"].items()
    }
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


@pytest.mark.parametrize("loss_type", ["dapo", "vespo"])
def test_vllm_importance_sampling_correction(loss_type, tmp_path):
    """The vLLM correction inputs (IS ratios; the sampler's log-probs in the off-policy mask):
    TRL's loss, metrics and gradients on fusetune's head, in fp32. vespo folds the ratios into
    its gamma weights, the others multiply the per-token loss by them."""
    model = tiny_model("llama", num_hidden_layers=1)
    config = dict(loss_type=loss_type, off_policy_mask_threshold=0.01, beta=0.0)
    want = loss_and_grads(copy.deepcopy(model), tmp_path, False, **config)
    calls = trl_integration.FusedHead.calls
    got = loss_and_grads(model, tmp_path, True, **config)
    assert trl_integration.FusedHead.calls > calls
    assert_close("loss", got[0], want[0], FP32_LOSS_TOL, atol=1e-7)
    assert got[1].keys() == want[1].keys()
    for name, value in want[1].items():
        assert_close(f"metric {name}", got[1][name], value, FP32_LOSS_TOL, atol=1e-6)
    for name, grad in want[2].items():
        assert_close(f"grad of {name}", got[2][name], grad, FP32_UPDATE_TOL, atol=1e-7)


@pytest.fixture
def bf16_rounded_to_nearest(monkeypatch):
    """Triton's CPU interpreter (3.x) truncates fp32 -> bf16 casts (round toward zero, ignoring
    fp_downcast_rounding); the GPU rounds to nearest. Truncation biases every bf16 gradient a
    kernel writes, which the bf16 comparison would measure instead of the kernels: round as
    the GPU does here (torch's conversion), for this test only."""
    if ON_GPU:
        return
    import numpy as np
    from triton.runtime import interpreter

    from fusetune._triton import tl

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            bits = values.view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, dst_type.scalar)
        return original(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


def distances(run, fp32_run):
    """Per logged metric, the largest step difference; and the parameter updates' relative
    distance (one norm over all parameters)."""
    metrics = {k: (run[0][k] - v).abs().max().item() for k, v in fp32_run[0].items()}
    diff = sum((run[1][n] - u).square().sum() for n, u in fp32_run[1].items())
    norm = sum(u.square().sum() for u in fp32_run[1].values())
    return metrics, (diff / norm).sqrt().item()


BF16_CASES = {
    "dapo-beta": dict(loss_type="dapo", beta=0.05),
    "grpo-sequence-iterations": dict(loss_type="grpo", importance_sampling_level="sequence",
                                     num_iterations=2),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_grpo_bf16_within_trls_own_distance(case, tmp_path, bf16_rounded_to_nearest):
    """bf16=True (autocast over fp32 weights): fusetune's run is no further from TRL's fp32 run
    than 1.5x TRL's own bf16 run is (plus a hair), in every logged metric and in the updates.
    Plain SGD, so that an update is proportional to its gradient (Adam's first step is the
    gradient's sign, which a rounding flips for the tiny gradients)."""
    config = dict(BF16_CASES[case], optim="sgd", learning_rate=0.1)
    model = tiny_model("llama", num_hidden_layers=1)
    fp32 = grpo_run(copy.deepcopy(model), tmp_path, None, **config)
    trl_bf16 = grpo_run(copy.deepcopy(model), tmp_path, None, bf16=True, **config)
    ours = grpo_run(model, tmp_path, HEAD_ONLY, bf16=True, **config)
    assert ours[2] > 0
    trl_metrics, trl_updates = distances(trl_bf16, fp32)
    our_metrics, our_updates = distances(ours, fp32)
    assert 0 < trl_updates < 0.1, trl_updates  # bf16 really ran, and stayed close
    assert our_updates <= 1.5 * trl_updates + 1e-4, (our_updates, trl_updates)
    for name, trl_distance in trl_metrics.items():
        slack = 1e-7 + 1e-4 * fp32[0][name].abs().max().item()
        assert our_metrics[name] <= 1.5 * trl_distance + slack, (name, our_metrics, trl_metrics)


def test_unserved_outputs_fall_back_with_a_warning(monkeypatch):
    calls = []

    class Original:
        @staticmethod
        def apply(*args):
            calls.append(args[-1])
            return "trl"

    monkeypatch.setitem(trl_integration._state, "original", Original)
    monkeypatch.setitem(trl_integration._state, "warned", set())
    monkeypatch.setitem(trl_integration._state, "serving", 1)  # inside a patched model's call
    hidden, weight = torch.randn(3, 8), torch.randn(16, 8)
    targets = torch.tensor([1, 2, 3])
    args = (hidden, weight, None, targets, 1.0, 32768, None, 1.0, ("log_probs", "mean_logits"))
    with pytest.warns(UserWarning, match="mean_logits") as warned:
        result = trl_integration.FusedHead.apply(*args)
        assert trl_integration.FusedHead.apply(*args) == "trl"  # one warning, not one a call
    assert len(warned) == 1
    assert result == "trl" and calls == [("log_probs", "mean_logits")] * 2


def test_apply_needs_a_trainer():
    with pytest.raises(TypeError, match="TRL trainer"):
        trl_integration.apply(torch.nn.Linear(2, 2))
