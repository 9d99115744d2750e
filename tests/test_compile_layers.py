"""fusetune.compile_layers: the decoder stack of a PEFT LoRA model patched by fusetune.apply,
compiled, trains as the eager patched model does (per-step losses, final adapters), the fused ops
run inside the compiled graph (forward and backward), it compiles once, and ``finetune
--compile`` runs, says so, and keeps compiling steps out of tokens/s.

CPU: aot_eager (traces the fake kernels and autograd registrations; Inductor's first compile of
a tiny model takes tens of seconds on 2 cores); GPU: Inductor."""

from __future__ import annotations

import json

import pytest
import torch

import fusetune
from fusetune.finetune import main
from fusetune.finetune.output import MARKER
from harness import DEVICE, ON_GPU, assert_close, fused_ops_run, graphs_compiled

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

BACKEND = "inductor" if ON_GPU else "aot_eager"
VOCAB, STEPS = 128, 3
TOL = 1e-5  # fp32, relative: compiled vs eager run the same kernels in the same order
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    initializer_range=0.1,
    pad_token_id=0,
)
# model type -> (extra config, attention, layers): Gemma 3 trains with eager attention and a
# sliding window; 4 Llama layers, so that a compile per layer would show (2 Gemma layers: time)
FAMILIES = {
    "llama": ({}, "sdpa", 4),
    "gemma3_text": (dict(sliding_window=4, query_pre_attn_scalar=8), "eager", 2),
}
# Graphs of the compiled stack: one, split where compile_layers builds transformers' attention
# masks eagerly (a break per mask builder: Gemma 3 has two); a compile per layer would be 4+.
MAX_GRAPHS = 3


# RMSNorms per decoder layer (Llama: the input norm and the attention residual's add + norm;
# Gemma 3: sandwich norms and q/k norms); each runs forward and backward in a training step,
# except the first layer's input norm: its input (the frozen embedding) and weight need no
# gradient, so it has no backward, and the final norm adds a forward. Per layer a rope forward
# and backward (both rotations) and a LoRA GLU forward and backward (the MLP); one fused loss.
NORMS = {"llama": 2, "gemma3_text": 6}


def lora_model(model_type: str, fused: bool = True, layers: int | None = None) -> torch.nn.Module:
    extra, attention, family_layers = FAMILIES[model_type]
    layers = layers or family_layers
    config = transformers.AutoConfig.for_model(
        model_type, **CONFIG, **extra, num_hidden_layers=layers
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    model = peft.get_peft_model(
        model.to(DEVICE),
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"),
    )
    generator = torch.Generator().manual_seed(2)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero, which would leave A without gradient
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return fusetune.apply(model) if fused else model


def batches(count: int, batch: int = 2, seq: int = 8) -> list[tuple[torch.Tensor, ...]]:
    """Right-padded batches (the last row shorter), labels masked on a prompt and the padding."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(3, VOCAB, (batch, seq), generator=generator)
        mask = torch.ones_like(ids)
        mask[-1, seq - 3 :] = 0
        labels = ids.masked_fill((torch.arange(seq) < 2) | (mask == 0), -100)
        out.append(tuple(t.to(DEVICE) for t in (ids, mask, labels)))
    return out


def train(model, data) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int], dict]:
    """AdamW steps; (per-step losses, the trained LoRA parameters, graphs compiled so far in
    the process after each step, fusetune's ops the last step ran: :func:`fused_ops_run`)."""
    model.train()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-3, eps=1e-5)
    losses, graphs = [], []
    for ids, mask, labels in data:

        def step(ids=ids, mask=mask, labels=labels):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            losses.append(loss.detach())

        ran = fused_ops_run(step) if len(losses) == len(data) - 1 else step()
        optimizer.step()
        optimizer.zero_grad()
        graphs.append(graphs_compiled())
    params = {n: p.detach().clone() for n, p in trainable.items()}
    return torch.stack(losses).cpu(), params, graphs, ran


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_compiled_stack_trains_as_the_eager_patched_model(model_type):
    """Same losses and adapters as eager over STEPS AdamW steps; the graphs compiled in the
    first step serve every later one, and there are fewer than one per layer (the stack is not
    compiled layer by layer); the last compiled step runs fusetune's ops in its forward and
    backward, as many as the model has norms, ropes and MLPs."""
    layers = FAMILIES[model_type][2]
    data = batches(STEPS)
    eager = lora_model(model_type)
    want_losses, want_params, _, _ = train(eager, data)
    torch._dynamo.reset()
    model = lora_model(model_type)
    assert fusetune.compile_layers(model, backend=BACKEND) == layers
    try:
        before = graphs_compiled()  # a process-wide count: torch._dynamo.reset() keeps it
        got_losses, got_params, graphs, ran = train(model, data)
        assert_close("per-step losses", got_losses, want_losses, TOL)
        assert got_params.keys() == want_params.keys() and want_params
        for name, param in want_params.items():
            assert_close(name, got_params[name], param, TOL)
        graphs = [count - before for count in graphs]
        assert 1 <= graphs[0] == graphs[-1] <= MAX_GRAPHS, graphs
        norms = NORMS[model_type] * layers
        want = {"rms_norm_forward": norms + 1, "rms_norm_backward": norms,
                "rope_rotate": 2 * layers, "lora_glu_forward": layers,
                "lora_glu_backward": layers, "linear_cross_entropy_forward": 1}  # fmt: skip
        assert {name: ran.get(name, 0) for name in want} == want, ran
        if model_type == "llama":  # the compiled stack has run: the check below needs one
            masks_stay_traceable_outside_compiled_stacks(data[0])
    finally:
        fusetune.revert(model)
        fusetune.revert(eager)


def masks_stay_traceable_outside_compiled_stacks(batch) -> None:
    """compile_layers builds masks eagerly only while its compiled stack runs: another model of
    the family still compiles whole with fullgraph=True (a disabled builder would break it).
    (Checked after the Llama stack above has trained: a model and stack of its own cost ~15 s
    of CI's CPU.)"""
    ids, mask, _ = batch
    config = transformers.AutoConfig.for_model("llama", **CONFIG, num_hidden_layers=1)
    other = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    other = other.to(DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(other, backend=BACKEND, fullgraph=True)
    want = other(input_ids=ids, attention_mask=mask).logits
    assert_close("logits", compiled(input_ids=ids, attention_mask=mask).logits, want, TOL)


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.get_base_model().model.layers


def test_layers_compiled_one_by_one_share_graphs_as_peft_layers_do():
    """Each decoder layer compiled on its own (torchtitan's way, what FSDP2 + compile needs):
    fusetune's layers share their graphs as plain PEFT's do (2: layer 0's input needs no
    gradient, the others' do), where a forward object per module (fusetune's patches before
    they went through the class) made Dynamo compile one graph per layer; the same losses and
    adapters as the eager patched model. Without a KV cache (training needs none): each layer
    reads its own cache layer's state, which recompiles PEFT's layers too."""
    data = batches(2)
    graphs = {}
    for fused in (False, True):  # plain PEFT first: a live patched model fuses the family's rope
        torch._dynamo.reset()
        model = lora_model("llama", fused=fused)
        model.get_base_model().config.use_cache = False  # a KV cache's layers differ: guards
        for layer in decoder_layers(model):
            layer.compile(backend=BACKEND)
        before = graphs_compiled()
        losses, params, counts, _ = train(model, data)
        graphs[fused] = [count - before for count in counts]
    layers = FAMILIES["llama"][2]
    assert graphs[False][0] == graphs[False][-1] < layers, graphs  # PEFT: shared, no recompile
    assert graphs[True][0] == graphs[True][-1] <= graphs[False][0], graphs
    eager = lora_model("llama")
    want_losses, want_params, _, _ = train(eager, data)
    assert_close("per-step losses", losses, want_losses, TOL)
    assert params.keys() == want_params.keys() and want_params
    for name, param in want_params.items():
        assert_close(name, params[name], param, TOL)
    fusetune.revert(model)
    fusetune.revert(eager)


# ----------------------------------------------------------------------------- finetune --compile

COMPILE = "default" if ON_GPU else "aot_eager"
TINY_RUN = ["--steps", "3", "--batch-size", "1", "--seq-len", "24", "--precision", "fp32"]


def test_finetune_compile_compare_runs_both_compiled(tmp_path, capsys):
    """--compile with --compare: both runs compiled (the comparison is fusetune's kernels, not
    the compiler), the same losses in fp32, compiling steps left out of tokens/s, and said."""
    output = tmp_path / "run"
    device = "cuda" if ON_GPU else "cpu"
    argv = [*TINY_RUN, "--device", device, "--output", str(output), "--compare"]
    code = main([*argv, "--compile", COMPILE])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "compile" in out and "one torch.compile graph" in out
    suffix = " + compile" + ("" if COMPILE == "default" else f" ({COMPILE})")
    assert f"HF + PEFT{suffix} 3/3" in err and f"HF + PEFT + fusetune{suffix} 3/3" in err
    runs = json.loads((output / MARKER).read_text())["runs"]
    assert [r["label"] for r in runs] == [f"HF + PEFT{suffix}", f"HF + PEFT + fusetune{suffix}"]
    torch.testing.assert_close(runs[0]["losses"], runs[1]["losses"], rtol=1e-4, atol=1e-4)
    for run in runs:  # the first step compiles: left out; same shapes after it: nothing more
        assert run["untimed_steps"] == 1 and run["tokens_per_s"] > 0, run
    assert "throughput" in out and "first 1 step left out" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gradient-checkpointing", "offload", "--full"], "--gradient-checkpointing on"),
        (["--gradient-checkpointing"], "with LoRA, not with --gradient-checkpointing"),
    ],
)
def test_finetune_compile_refuses_checkpointing_it_cannot_trace(tmp_path, capsys, extra, message):
    assert main(["--compile", *extra, "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "argument --compile" in err and message in err, err
    assert not (tmp_path / "o").exists()


def test_finetune_compile_reduce_overhead_refused_under_torchrun(tmp_path, capsys, monkeypatch):
    """Under torchrun --compile runs (tests/test_compile_fsdp.py), but not reduce-overhead: its
    CUDA graphs replay fixed addresses where FSDP2 gathers each layer's weights anew."""
    from fusetune.finetune import command, distributed

    monkeypatch.setattr(
        command.distributed, "setup", lambda device: (distributed.Ranks(0, 2), device)
    )
    argv = ["--compile", "reduce-overhead", "--output", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "reduce-overhead runs on one process" in err and "torchrun" in err
    assert not (tmp_path / "o").exists()
