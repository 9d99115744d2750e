"""TRL's fused LM head, served by fusetune, on an FSDP2-sharded model at 2 ranks against one
process on the same rows: per-token log-probs and entropy, and the gradients of every parameter
(the lm_head's included), in fp32 within 1e-5. Layouts: the head in the root's group (as
accelerate's FSDP2 plugin shards: decoder layers, then the root) and the head sharded on its own
(torchtitan's layout), resharded after forward or not. There TRL 1.16 reads a sharded DTensor
and gathers it with ``full_tensor()``, whose backward does not reduce the head's gradient over
ranks; fusetune runs the head inside its own FSDP call instead (the weight gathered once a call,
the gradient reduce-scattered by FSDP): the counts below check that the fused kernel ran on
every call and that the head module ran once a call (FSDP's gather). A DTensor head outside an
FSDP2 module warns once, naming the module and the reason.

Gloo on the CPU (FSDP2 runs there by hand; accelerate's FSDP plugin does not: see
tests/test_grpo_distributed.py), NCCL on a machine with 2 GPUs."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness import assert_close, free_port
from test_distributed import DEEPSPEED, join, zero3_config
from test_transformers import VOCAB, tiny_model

pytest.importorskip("trl")
pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() == 1, reason="2 ranks need 2 GPUs (NCCL) or none (gloo)"
)
WORLD, BATCH, SEQ, CALLS = 2, 4, 8, 2  # CALLS: head calls a step (TRL's batch chunks)
LAYOUTS = (("root", True), ("head", True), ("head", False))


class Trainer:
    """The part of a TRL trainer fusetune.apply reads (TRL's trainers are too slow to build
    at every rank here); ``__module__`` makes it one for fusetune's check."""

    __module__ = "trl.stub"

    def __init__(self, model):
        self.model, self.ref_model = model, None


def trl_model(device: torch.device, tied: bool = False):
    """The tiny Llama with TRL's fused head (as GRPOTrainer adds it), served by fusetune."""
    from trl.trainer.utils import add_fused_lm_head

    import fusetune

    model = tiny_model("llama", num_hidden_layers=2, tie_word_embeddings=tied).to(device)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    trainer = Trainer(model)
    # the head alone: the backbone's ops are tested elsewhere (and slow in the interpreter)
    fusetune.apply(trainer, rms_norm=False, rope=False, mlp=False)
    return model, trainer


def rows(device: torch.device, rank: int = 0, world: int = 1):
    """CALLS batches of token ids and labels (a random prompt masked with -100), this rank's
    rows of each."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(CALLS):
        ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
        prompt = torch.randint(1, SEQ // 2, (BATCH, 1), generator=generator)
        labels = ids.masked_fill(torch.arange(SEQ) < prompt, -100)
        out.append((ids.chunk(world)[rank].to(device), labels.chunk(world)[rank].to(device)))
    return out


def step(model, batches, world: int = 1):
    """One backward over CALLS fused-head calls: log-probs weighted by position plus an
    entropy term (both outputs' gradients), summed over this rank's rows; times ``world``, as
    FSDP averages the gradients over ranks. Returns (log-probs, entropy), detached."""
    log_probs, entropy = [], []
    for ids, labels in batches:
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        weights = torch.linspace(0.5, 1.5, SEQ - 1, device=ids.device)
        loss = (out.log_probs * weights).sum() + 0.3 * out.entropy.sum()
        (loss * world).backward()
        log_probs.append(out.log_probs.detach().cpu())
        entropy.append(out.entropy.detach().cpu())
    return torch.cat(log_probs), torch.cat(entropy)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).cpu()


def worker(rank: int, port: int, results: str) -> None:
    """Both engines' runs on this rank, in one process group (a spawn of 2 ranks costs ~25 s
    of imports on CI's CPU), joined by `join`: FSDP2's first, then, where deepspeed is
    installed, ZeRO-3's."""
    device = join(rank, port)
    found = {"fsdp2": fsdp2_runs(rank, device)}
    if DEEPSPEED:
        found["zero3"] = zero3_runs(rank, device)
    if rank == 0:
        torch.save(found, results)
    dist.barrier()  # no rank tears its gloo pairs down while rank 0 saves
    dist.destroy_process_group()


def fsdp2_runs(rank: int, device: torch.device) -> dict:
    from torch.distributed.fsdp import fully_shard

    import fusetune
    from fusetune.integrations.trl import FusedHead

    found = {}
    for layout, reshard in LAYOUTS:
        model, trainer = trl_model(device)
        head_calls = []
        model.lm_head.register_forward_pre_hook(lambda *_, calls=head_calls: calls.append(1))
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=reshard)
        if layout == "head":
            fully_shard(model.lm_head, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        served = FusedHead.calls
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no fallback, no warning
            warnings.filterwarnings("ignore", ".*TensorFloat32.*")
            log_probs, entropy = step(model, rows(device, rank, WORLD), WORLD)
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, (log_probs, entropy))
        found[(layout, reshard)] = dict(
            log_probs=torch.cat([g[0] for g in gathered]).view(WORLD, CALLS, -1, SEQ - 1),
            entropy=torch.cat([g[1] for g in gathered]).view(WORLD, CALLS, -1, SEQ - 1),
            grads={n: full(p.grad) for n, p in model.named_parameters()},
            served=FusedHead.calls - served,
            head_calls=len(head_calls),
            head_sharded=type(model.lm_head.weight).__name__,
        )
        fusetune.revert(trainer)
    found["dtensor_warning"] = dtensor_head_warns(device)
    return found


def dtensor_head_warns(device: torch.device) -> list[str]:
    """A head whose weight is a DTensor without an FSDP2 module of its own (sharded by hand):
    fusetune serves TRL's gathered weight and says once why the route is not FSDP's."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    model, trainer = trl_model(device)
    mesh = init_device_mesh(device.type, (WORLD,))
    weight = distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)])
    model.lm_head.weight = torch.nn.Parameter(weight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ids, labels in rows(device) * 2:  # twice: one warning
            model(input_ids=ids, labels=labels, fused_lm_head=True)
    import fusetune

    fusetune.revert(trainer)
    return [str(w.message) for w in caught if "DTensor" in str(w.message)]


def test_trl_head_under_fsdp2_and_zero3_matches_one_process(tmp_path):
    """FSDP2 (three layouts) and then, where deepspeed is installed, ZeRO-3 (check_zero3), on
    the same 2 ranks (one spawn): TRL's fused head equals one process's."""
    from fusetune.integrations.trl import FusedHead

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, trainer = trl_model(device)
    served = FusedHead.calls
    want_log_probs, want_entropy = step(model, rows(device))
    assert FusedHead.calls - served == CALLS
    import fusetune

    fusetune.revert(trainer)
    results = tmp_path / "rank0.pt"
    mp.spawn(worker, args=(free_port(), str(results)), nprocs=WORLD, join=True)
    both = torch.load(results, weights_only=False)
    found = both["fsdp2"]
    # rank r's rows of call c: rows [r * B/2, (r + 1) * B/2) of the single process's call c
    want_log_probs = want_log_probs.view(CALLS, WORLD, -1, SEQ - 1).transpose(0, 1)
    want_entropy = want_entropy.view(CALLS, WORLD, -1, SEQ - 1).transpose(0, 1)
    for layout, reshard in LAYOUTS:
        got, label = found[(layout, reshard)], f"{layout} reshard={reshard}"
        assert got["served"] == CALLS, (label, got["served"])  # fusetune's kernel every call
        assert got["head_calls"] == (CALLS if layout == "head" else 0), (label, got)
        assert got["head_sharded"] == "DTensor", label  # the parameter stays sharded
        assert_close(f"{label} log-probs", got["log_probs"], want_log_probs, 1e-5)
        assert_close(f"{label} entropy", got["entropy"], want_entropy, 1e-5)
        for name, param in model.named_parameters():
            assert_close(f"{label} grad {name}", got["grads"][name], param.grad, 1e-5)
    warned = found["dtensor_warning"]
    assert len(warned) == 1 and "LlamaForCausalLM.lm_head" in warned[0], warned
    check_zero3(both.get("zero3"), device)


# ----------------------------------------------------------------------------- DeepSpeed ZeRO-3


def zero3_runs(rank: int, device: torch.device) -> dict:
    """TRL's fused head on a ZeRO-3 engine (every parameter partitioned), the head untied or
    tied to the embedding: per-token outputs, full gradients, fusetune's calls, the head's own
    calls, and no fallback warning."""
    import deepspeed

    import fusetune
    from fusetune.integrations.trl import FusedHead

    config = zero3_config(BATCH // WORLD, lr=1e-3)
    found = {}
    for tied in (False, True):
        model, trainer = trl_model(device, tied)
        head_calls = []
        model.lm_head.register_forward_pre_hook(lambda *_, calls=head_calls: calls.append(1))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)  # fmt: skip
        served = FusedHead.calls
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no fallback, no warning
            warnings.filterwarnings("ignore", ".*TensorFloat32.*|.*deprecated.*")
            total, log_probs, entropy = 0.0, [], []
            for ids, labels in rows(device, rank, WORLD):
                out = engine(input_ids=ids, labels=labels, fused_lm_head=True)
                weights = torch.linspace(0.5, 1.5, SEQ - 1, device=ids.device)
                total = total + (out.log_probs * weights).sum() + 0.3 * out.entropy.sum()
                log_probs.append(out.log_probs.detach().cpu())
                entropy.append(out.entropy.detach().cpu())
            engine.backward(total * WORLD)  # ZeRO averages the gradients over ranks
        grads = {n: deepspeed.utils.safe_get_full_grad(p) for n, p in model.named_parameters()}
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, (torch.cat(log_probs), torch.cat(entropy)))
        found[tied] = dict(
            log_probs=torch.cat([g[0] for g in gathered]).view(WORLD, CALLS, -1, SEQ - 1),
            entropy=torch.cat([g[1] for g in gathered]).view(WORLD, CALLS, -1, SEQ - 1),
            grads={n: g.detach().cpu() for n, g in grads.items() if g is not None},
            served=FusedHead.calls - served,
            head_calls=len(head_calls),
        )
        fusetune.revert(trainer)
    return found


def check_zero3(found: dict | None, device: torch.device) -> None:
    """ZeRO-3 partitions the head (or the embedding it is tied to): fusetune's kernel runs
    inside the head's own call on every TRL head call (ZeRO's hooks gather the weight and
    reduce its gradient), and the outputs and full gradients equal one process's. (The
    FSDP2 test's ranks ran it after their FSDP2 runs.)"""
    pytest.importorskip("deepspeed")  # not a dependency: carried to the GPU machine
    import fusetune
    from fusetune.integrations.trl import FusedHead

    want = {}
    for tied in (False, True):
        model, trainer = trl_model(device, tied)
        served = FusedHead.calls
        log_probs, entropy = step(model, rows(device))
        assert FusedHead.calls - served == CALLS
        fusetune.revert(trainer)
        want[tied] = (log_probs, entropy, {n: p.grad for n, p in model.named_parameters()})
    for tied in (False, True):
        got, label = found[tied], f"tied={tied}"
        want_log_probs, want_entropy, want_grads = want[tied]
        assert got["served"] == CALLS and got["head_calls"] == CALLS, (label, got["served"])
        want_log_probs = want_log_probs.view(CALLS, WORLD, -1, SEQ - 1).transpose(0, 1)
        want_entropy = want_entropy.view(CALLS, WORLD, -1, SEQ - 1).transpose(0, 1)
        assert_close(f"{label} log-probs", got["log_probs"], want_log_probs, 1e-5)
        assert_close(f"{label} entropy", got["entropy"], want_entropy, 1e-5)
        assert got["grads"].keys() == want_grads.keys(), label
        for name, grad in want_grads.items():
            assert_close(f"{label} grad {name}", got["grads"][name], grad.cpu(), 1e-5)
