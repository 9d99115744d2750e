"""fusetune.graph_train_step: the whole step replayed from one CUDA graph trains as the same
step run eagerly (twins from one seed, fresh batches each step), replays without Python, follows
a tensor learning rate, and refuses what a graph cannot do, naming the argument.

The CUDA cases run in the GPU pass only (a CUDA graph needs a GPU); the argument checks run
everywhere."""

import peft
import pytest
import torch
import transformers

import fusetune
from harness import DEVICE

CUDA = pytest.mark.skipif(DEVICE.type != "cuda", reason="a CUDA graph needs a GPU")
BATCH, SEQ, VOCAB, STEPS = 2, 24, 96, 7


def tiny_lora_llama(fused: bool, dtype=torch.float32):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE, dtype)
    model.config.use_cache = False
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    model = peft.get_peft_model(model, lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: A would get no gradient
            torch.nn.init.normal_(param, std=0.2)
    if fused:
        fusetune.apply(model)
    return model


def tiny_qwen3_moe(fused: bool):
    """Routed experts and transformers' router load-balancing loss (output_router_logits),
    all parameters trained."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, moe_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, use_cache=False, output_router_logits=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(DEVICE)
    return fusetune.apply(model) if fused else model


def adamw(model, lr, capturable=True):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, capturable=capturable)


def batches(count):
    """Two batches in turn: each call brings other data, and the loss can fall."""
    generator = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(2)]
    for index in range(count):
        ids = pool[index % 2].to(DEVICE)
        labels = ids.clone()
        labels[:, : SEQ // 3] = -100  # a prompt: no loss on it
        yield ids, labels


def eager_losses(model, optimizer, autocast_dtype, max_grad_norm, lrs=None):
    losses = []
    for index, (ids, labels) in enumerate(batches(STEPS)):
        if lrs is not None:
            optimizer.param_groups[0]["lr"].fill_(lrs[index])
        with torch.autocast("cuda", dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):  # fmt: skip
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], max_grad_norm, foreach=True
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def graphed_losses(model, optimizer, autocast_dtype, max_grad_norm, lrs=None):
    first_ids, first_labels = next(batches(1))
    step = fusetune.graph_train_step(model, optimizer, first_ids, first_labels,
                                     autocast_dtype=autocast_dtype, max_grad_norm=max_grad_norm,
                                     warmup=2)  # fmt: skip
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    losses = []
    for index, (ids, labels) in enumerate(batches(STEPS)):
        if lrs is not None:
            optimizer.param_groups[0]["lr"].fill_(lrs[index])
        losses.append(float(step(ids, labels)))
    assert step.captured
    # 2 eager warm-up steps and the capture ran Python; the other 4 steps were replays
    assert len(forwards) == 3, len(forwards)
    return losses


@CUDA
@pytest.mark.parametrize(
    "fused,autocast_dtype,max_grad_norm",
    [(True, None, 0.0), (False, None, 0.5), (True, torch.bfloat16, 1.0)],
    ids=["fusetune-fp32", "peft-fp32-clipped", "fusetune-bf16-autocast-clipped"],
)
def test_graphed_step_trains_as_the_eager_step(fused, autocast_dtype, max_grad_norm):
    eager_model, graph_model = tiny_lora_llama(fused), tiny_lora_llama(fused)
    twins_train_alike(eager_model, graph_model, autocast_dtype, max_grad_norm)


@CUDA
def test_graphed_moe_step_with_the_router_loss_trains_as_the_eager_step():
    """transformers counts the router's assignments with bincount (a sync) when no mask is
    given: fusetune hands it an all-ones mask while capturing."""
    twins_train_alike(tiny_qwen3_moe(True), tiny_qwen3_moe(True), None, 0.0)


def twins_train_alike(eager_model, graph_model, autocast_dtype, max_grad_norm):
    eager = eager_losses(eager_model, adamw(eager_model, 3e-2), autocast_dtype, max_grad_norm)
    graph = graphed_losses(graph_model, adamw(graph_model, 3e-2), autocast_dtype, max_grad_norm)
    tol = 1e-5 if autocast_dtype is None else 2e-2
    assert eager[-1] < eager[0] - 0.03, eager  # it trains
    torch.testing.assert_close(torch.tensor(graph), torch.tensor(eager), rtol=tol, atol=tol)
    for (name, want), got in zip(eager_model.named_parameters(), graph_model.parameters(),
                                 strict=True):  # fmt: skip
        if want.requires_grad:
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)


@CUDA
def test_a_tensor_lr_follows_its_schedule_and_a_changed_float_lr_is_an_error():
    lrs = [1e-2 * (STEPS - i) / STEPS for i in range(STEPS)]
    eager_model, graph_model = tiny_lora_llama(True), tiny_lora_llama(True)
    eager_opt = adamw(eager_model, torch.tensor(lrs[0], device=DEVICE))
    graph_opt = adamw(graph_model, torch.tensor(lrs[0], device=DEVICE))
    eager = eager_losses(eager_model, eager_opt, None, 0.0, lrs)
    graph = graphed_losses(graph_model, graph_opt, None, 0.0, lrs)
    torch.testing.assert_close(torch.tensor(graph), torch.tensor(eager), rtol=1e-5, atol=1e-5)

    model = tiny_lora_llama(True)
    optimizer = adamw(model, 1e-3)
    ids, labels = next(batches(1))
    step = fusetune.graph_train_step(model, optimizer, ids, labels, warmup=1)
    step(ids, labels)
    step(ids, labels)  # captured
    optimizer.param_groups[0]["lr"] = 5e-4
    with pytest.raises(ValueError, match="lr changed from 0.001 to 0.0005"):
        step(ids, labels)


def test_arguments_are_checked_by_name():
    model = tiny_lora_llama(False)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="optimizer must be built with capturable=True"):
        fusetune.graph_train_step(model, adamw(model, 1e-3, capturable=False), ids)
    optimizer = adamw(model, 1e-3)
    if DEVICE.type != "cuda":
        with pytest.raises(ValueError, match="input_ids must be int64 on a CUDA device"):
            fusetune.graph_train_step(model, optimizer, ids)
        return
    with pytest.raises(ValueError, match="input_ids must be int64"):
        fusetune.graph_train_step(model, optimizer, ids.int())
    with pytest.raises(ValueError, match=r"labels must be \(2, 24\)"):
        fusetune.graph_train_step(model, optimizer, ids, ids[:, 1:])
    with pytest.raises(ValueError, match="autocast_dtype must be"):
        fusetune.graph_train_step(model, optimizer, ids, autocast_dtype=torch.float32)
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        fusetune.graph_train_step(model, optimizer, ids, warmup=0)
    with pytest.raises(ValueError, match="max_grad_norm must be >= 0"):
        fusetune.graph_train_step(model, optimizer, ids, max_grad_norm=-1.0)
    if not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="process_group given, but torch.distributed is not"):
            fusetune.graph_train_step(model, optimizer, ids, process_group=object())
    step = fusetune.graph_train_step(model, optimizer, ids)
    with pytest.raises(ValueError, match=r"input_ids must be \(2, 24\) torch.int64"):
        step(ids[:, :-1])


# ------------------------------------------------------------------ data parallel, 2 GPUs
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="data parallel on 2 GPUs")


def data_parallel_rank(rank: int, port: int, folder: str) -> None:
    """One rank: row ``rank`` of every batch, the gradients averaged inside the graph."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    try:
        model = tiny_lora_llama(True)
        losses = train_data_parallel(model, rank)
        if rank == 0:
            trained = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
            torch.save({"losses": (losses / 2).cpu(), "params": trained}, f"{folder}/rank0.pt")
    finally:
        # the step (its graph holds the captured all-reduce) is gone by now: destroying the
        # process group under a live graph that captured its collectives hangs
        torch.cuda.synchronize()
        dist.destroy_process_group()


def train_data_parallel(model, rank: int) -> torch.Tensor:
    """Row ``rank`` of every batch through a graphed step; the losses summed over both ranks
    (each row has as many labels: the batch's mean, twice)."""
    import torch.distributed as dist

    ids, labels = next(batches(1))
    mine = slice(rank, rank + 1)
    step = fusetune.graph_train_step(model, adamw(model, 1e-3), ids[mine], labels[mine],
                                     warmup=2, process_group=dist.group.WORLD)  # fmt: skip
    losses = torch.stack([step(ids[mine], labels[mine]) for ids, labels in batches(STEPS)])
    dist.all_reduce(losses)
    assert step.captured
    return losses


@TWO_GPUS
def test_data_parallel_graph_trains_as_one_process_on_the_whole_batch(tmp_path):
    """Two ranks, one row of each batch apiece, the adapters' gradients averaged by an
    all-reduce captured in the graph: the losses of one process on both rows, eagerly."""
    import torch.multiprocessing as mp

    from harness import free_port

    model = tiny_lora_llama(True)
    want = eager_losses(model, adamw(model, 1e-3, capturable=False), None, 0.0)
    mp.spawn(data_parallel_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt")
    torch.testing.assert_close(got["losses"].tolist(), want, rtol=1e-5, atol=1e-5)
    # (AdamW moves an element whose gradient is ~0 by ~lr whatever its sign: 1e-3)
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(got["params"][name], param.detach().cpu(), rtol=0, atol=1e-3)


# ------------------------------------------------------------------ finetune --cuda-graph


def finetune_losses(folder, *argv: str) -> list[float]:
    from fusetune.finetune import main
    from fusetune.finetune.output import MARKER

    code = main(["--steps", "6", "--batch-size", "2", "--seq-len", "64", "--precision", "fp32",
                 "--lr-schedule", "cosine", "--warmup-steps", "2", "--output", str(folder),
                 *argv])  # fmt: skip
    assert code == 0
    import json

    return json.loads((folder / MARKER).read_text())["runs"][0]["losses"]


def count_captures(monkeypatch) -> list[int]:
    """graphed_step.capture, counted: the list gets an item a capture."""
    from fusetune import graphed_step

    captured = []
    real = graphed_step.capture
    monkeypatch.setattr(graphed_step, "capture", lambda *args: captured.append(1) or real(*args))
    return captured


@CUDA
def test_finetune_cuda_graph_trains_as_the_eager_loop(tmp_path, monkeypatch):
    """Batches padded to one length and passed without their mask, three graphs a step
    (forward and backward, the norm, the update after the host's check), a tensor learning rate
    on a cosine schedule with warmup, clipping: the eager loop's losses, and the graphs really
    captured (three, once)."""
    captured = count_captures(monkeypatch)
    eager = finetune_losses(tmp_path / "eager")
    graph = finetune_losses(tmp_path / "graph", "--cuda-graph")
    assert len(captured) == 3
    torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)


@CUDA
def test_finetune_cuda_graph_accumulates_as_the_eager_loop(tmp_path, monkeypatch):
    """--grad-accum 2: the first micro-batch's graph writes the gradients, the second's adds to
    them; the eager loop's losses, and four graphs captured once (the second micro-batch's too)."""
    captured = count_captures(monkeypatch)
    eager = finetune_losses(tmp_path / "eager", "--grad-accum", "2")
    graph = finetune_losses(tmp_path / "graph", "--grad-accum", "2", "--cuda-graph")
    assert len(captured) == 4
    torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)


@CUDA
def test_step_graphs_write_the_gradients_afresh_then_add_the_other_micro_batches():
    """A batch alone, or twice in one step (each micro-batch's loss then over twice the tokens):
    the same loss and gradients only if the first micro-batch's graph overwrites the gradients
    (adding, it would double them) and the next one's adds to them (overwriting, it would halve
    them). A zero learning rate keeps the weights, so every step sees the same ones."""
    from fusetune.finetune import train
    from fusetune.finetune.data import Batch
    from fusetune.finetune.precision import Precision

    model = tiny_lora_llama(True)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for _, p in named], lr=torch.tensor(0.0, device=DEVICE),
                                  weight_decay=0.0, fused=True, capturable=True)  # fmt: skip
    state = train._State(model, named, optimizer, scaler=None)
    settings = train.TrainSettings(0.0, 0.0, Precision("fp32", "a test"), DEVICE, cuda_graph=True)
    ids, labels = (t.cpu() for t in next(batches(1)))
    labelled = int((labels[:, 1:] != -100).sum())
    batch = Batch(ids, torch.ones_like(ids), labels, tokens=ids.numel(), label_count=labelled)
    for _ in range(train.GRAPH_WARMUP_STEPS):  # eager, as train's: autotuning, AdamW's state
        train._step(state, [batch, batch], settings, 0)
    graphs = train._StepGraphs(state, [batch, batch], settings)

    def step(micro_batches):
        loss, fault, _ = graphs.step(state, micro_batches, 0)
        assert fault is None
        return loss, [p.grad.clone() for p in state.params]

    alone = step([batch])
    assert all(grad.abs().sum() > 0 for grad in alone[1])
    torch.testing.assert_close(step([batch, batch]), alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step([batch]), alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--compile"], "--cuda-graph: not with --compile"),
        (["--gradient-checkpointing", "offload"], "not with --gradient-checkpointing offload"),
    ],
    ids=["compile", "offload"],
)
def test_finetune_cuda_graph_refuses_what_a_graph_cannot_do(tmp_path, capsys, argv, message):
    from fusetune.finetune import main

    assert main(["--cuda-graph", "--output", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_finetune_cuda_graph_on_the_cpu_or_in_fp16_says_why(tmp_path, capsys):
    from fusetune.finetune import main

    argv = ["--cuda-graph", "--steps", "1", "--output", str(tmp_path / "out")]
    if DEVICE.type != "cuda":
        assert main(argv) == 2
        assert "--cuda-graph needs a CUDA device; this run's is cpu" in capsys.readouterr().err
    else:
        assert main([*argv, "--precision", "fp16"]) == 2
        assert "not with fp16 loss scaling" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
