"""`trainer.compile`: each decoder block's parts around attention compiled (`parallelize.apply_compile`), equal to
the eager block in values and gradients (fp32, 1e-5), with and without activation checkpointing, compiled once
for every block and every packing of the same length (attention's per-document loop stays eager), parameter
names unchanged."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch._dynamo.utils import counters

from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.rl.packing import pack_row
from pipelinerl_fsdp.training import parallelize
from pipelinerl_fsdp.training.parallelize import apply_activation_checkpointing, apply_compile, resolve_compile

# a tiny model: 2 blocks, so that the second reuses the first's graphs
ARGS = flavour_args("debug", vocab_size=64, num_hidden_layers=2, hidden_size=64, intermediate_size=128)
TOL = {"rtol": 1e-5, "atol": 1e-5}


def test_compile_is_on_only_where_set_or_measured_faster(monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    # measured faster nowhere yet: "auto" compiles on no device
    assert not resolve_compile("auto", cuda) and not resolve_compile("auto", cpu)
    monkeypatch.setattr(parallelize, "MEASURED_FASTER_COMPILED", frozenset({"cuda"}))
    assert resolve_compile("auto", cuda) and not resolve_compile("auto", cpu)
    assert resolve_compile("on", cpu) and not resolve_compile("off", cuda)
    with pytest.raises(ValueError, match="trainer.compile"):
        resolve_compile("yes", cpu)


def packed(lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return pack_row([torch.randint(0, 64, (n,), generator=g).tolist() for n in lengths])


def logp_and_grads(model: torch.nn.Module, lengths: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    row = packed(lengths)
    model.zero_grad()
    logp, _ = model(row.input_ids, row.position_ids, targets=row.targets)
    (logp * torch.linspace(0.5, 1.5, logp.shape[1])).sum().backward()
    return logp.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpointing", ["off", "full"])
def test_compiled_blocks_equal_the_eager_ones_and_compile_once(checkpointing: str):
    torch._dynamo.reset()
    counters.clear()
    eager = build_model(ARGS, seed=3)
    apply_activation_checkpointing(eager, checkpointing, 1)
    compiled = copy.deepcopy(eager)
    assert apply_compile(compiled) == ARGS.num_hidden_layers
    assert list(compiled.state_dict()) == list(eager.state_dict())  # the HF names stay
    start = time.perf_counter()
    got, got_grads = logp_and_grads(compiled, [7, 20, 5])  # three documents: attention's loop runs 3 times
    compile_s = time.perf_counter() - start
    want, want_grads = logp_and_grads(eager, [7, 20, 5])
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, **TOL)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2, graphs  # at most pre_attention and post_attention, shared by both blocks
    # another packing of the same 29 positions: no new graph (the documents never reach a compiled part)
    got, _ = logp_and_grads(compiled, [10, 10, 12])
    torch.testing.assert_close(got, logp_and_grads(eager, [10, 10, 12])[0], **TOL)
    assert counters["stats"]["unique_graphs"] == graphs
    # other lengths: at most one recompile per graph (dynamo's policy: a dynamic length), however many lengths
    for lengths in ([12, 12, 4, 4], [30, 9], [3, 3, 3, 50]):
        got, _ = logp_and_grads(compiled, lengths)
        torch.testing.assert_close(got, logp_and_grads(eager, lengths)[0], **TOL)
    assert counters["stats"]["unique_graphs"] <= 2 * graphs, counters["stats"]["unique_graphs"]
    print(f"compile + first step: {compile_s:.1f} s (checkpointing {checkpointing})")


def test_compiled_blocks_train_under_fsdp_as_the_eager_ones():
    """Compiled before FSDP2 wraps the blocks (as the trainer does), on a one-rank gloo mesh: the same log-probs
    and the same sharded gradients as the eager model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipelinerl_fsdp.training.parallelize import apply_fsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        eager = build_model(ARGS, seed=5)
        compiled = copy.deepcopy(eager)
        apply_compile(compiled)
        results = [
            logp_and_grads(apply_fsdp(m, mesh, torch.float32, torch.float32), [9, 16, 6]) for m in (compiled, eager)
        ]
        torch.testing.assert_close(results[0][0], results[1][0], **TOL)
        for a, b in zip(results[0][1], results[1][1]):
            torch.testing.assert_close(a.full_tensor(), b.full_tensor(), **TOL)
    finally:
        dist.destroy_process_group()
