"""FSDP2 set-up choices on a one-rank gloo group: activation checkpointing (same gradients, fewer saved
activations), the head's precision settings under bf16 mixed precision, gradients reduced per micro-batch unless
deferred, and a step whose batch comes in parts (`rl.waves`)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.rl.packing import PackedRow
from pipelinerl_fsdp.training.parallelize import (
    HeadPrecision,
    apply_activation_checkpointing,
    apply_fsdp,
    resolve_fp32_head,
)
from pipelinerl_fsdp.training.train_step import forward_backward

ARGS = flavour_args("debug", vocab_size=64)


@pytest.fixture(scope="module")
def mesh() -> Iterator:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def batch(t: int = 48, seed: int = 0) -> PackedRow:
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(t // 2), torch.arange(t - t // 2)])[None]
    seq = torch.cat([torch.zeros(t // 2), torch.ones(t - t // 2)]).long()[None]
    return PackedRow(torch.randint(0, 64, (1, t), generator=g), pos, torch.randint(0, 64, (1, t), generator=g), seq)


def saved_bytes(model: torch.nn.Module, mb: PackedRow) -> tuple[int, list[torch.Tensor]]:
    """Bytes autograd keeps for the backward pass of one forward, and the gradients after it."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = model(mb.input_ids, mb.position_ids, targets=mb.targets)
    logp.sum().backward()
    return total, [p.grad.clone() for p in model.parameters()]


def test_activation_checkpointing_same_gradients_fewer_saved_activations():
    plain = build_model(ARGS, seed=3)
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt, "full", 1) == ARGS.num_hidden_layers
    mb = batch()
    kept_plain, g_plain = saved_bytes(plain, mb)
    kept_ckpt, g_ckpt = saved_bytes(ckpt, mb)
    for a, b in zip(g_plain, g_ckpt):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert kept_ckpt < 0.5 * kept_plain, (kept_ckpt, kept_plain)
    assert apply_activation_checkpointing(ckpt, "full", 2) == (ARGS.num_hidden_layers + 1) // 2
    assert apply_activation_checkpointing(ckpt, "off", 1) == 0


def test_fp32_head_setting_resolves_to_the_root_dtype_and_the_logits_rounding():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert resolve_fp32_head("on", bf16) == HeadPrecision(fp32, round_logits=False)
    assert resolve_fp32_head("auto", bf16) == HeadPrecision(bf16, round_logits=False)
    assert resolve_fp32_head("off", bf16) == HeadPrecision(bf16, round_logits=True)
    assert resolve_fp32_head("auto", fp32).root_dtype == resolve_fp32_head("on", fp32).root_dtype == fp32


def test_each_head_setting_computes_logprobs_at_its_precision(mesh):
    """Under bf16 blocks: "on" equals an fp32 computation from the final hidden states with the fp32 master
    weights; "auto" (bf16 root) equals the fp64 computation from the bf16 hidden states and the bf16-gathered
    weights, so only the operands carry bf16 rounding; "off" adds the rounding of the logits to bf16. The head
    weight's gradient (reduced in fp32) under "auto" is the fp32 head's within bf16 precision."""
    reference = build_model(ARGS, seed=5)
    with torch.no_grad():  # logits of a trained model's size (an init's are ~0.1, where bf16 rounding is small)
        reference.lm_head.weight.mul_(20.0)
    mb = batch(64, seed=1)
    errors, grads = {}, {}
    for setting in ("on", "auto", "off"):
        head = resolve_fp32_head(setting, torch.bfloat16)
        model = apply_fsdp(copy.deepcopy(reference), mesh, torch.bfloat16, torch.float32, head)
        hidden: list[torch.Tensor] = []
        model.model.norm.register_forward_hook(lambda m, i, out, keep=hidden: keep.append(out.detach()))
        logp, _ = model(mb.input_ids, mb.position_ids, targets=mb.targets)
        logp.mean().backward()
        grads[setting] = model.lm_head.weight.grad.full_tensor()
        assert hidden[0].dtype == head.root_dtype
        weight = reference.lm_head.weight.detach().to(head.root_dtype).double()
        exact = torch.log_softmax(hidden[0].double() @ weight.t(), -1)
        exact = exact.gather(-1, mb.targets[..., None])[..., 0]
        errors[setting] = (logp.detach().double() - exact).abs().max().item()
    # logits up to ~14: fp32 sums are good to ~1e-5 there, an ulp of bf16 is 0.0625
    assert errors["on"] < 3e-5 and errors["auto"] < 3e-5 and errors["off"] > 1e-2, errors
    assert grads["auto"].dtype == torch.float32
    assert (grads["auto"] - grads["on"]).norm() < 2e-2 * grads["on"].norm()


@pytest.mark.parametrize("defer", [False, True])
def test_gradients_are_reduced_per_micro_batch_unless_deferred(mesh, defer: bool):
    model = apply_fsdp(build_model(ARGS, seed=7), mesh, torch.float32, torch.float32)
    seen: list[bool] = []

    def loss_fn(logp, ent, mb):
        # runs after the previous micro-batch's backward: are this rank's gradient shards there yet? (a block's
        # parameters: the blocks are resharded after their forward, the root's are not)
        seen.append(any(p.grad is not None for p in model.model.layers[0].parameters()))
        return logp.sum(), None

    micro = [batch(seed=i) for i in range(3)]
    forward_backward(model, micro, loss_fn, 1.0, None, torch.device("cpu"), defer_grad_sync=defer)
    assert seen == [False, not defer, not defer]
    grads = [p.grad.full_tensor().clone() for p in model.parameters()]
    # the same sum of gradients either way
    model.zero_grad()
    forward_backward(model, micro, loss_fn, 1.0, None, torch.device("cpu"), defer_grad_sync=not defer)
    for a, p in zip(grads, model.parameters()):
        torch.testing.assert_close(a, p.grad.full_tensor(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("defer", [False, True])
def test_a_step_in_parts_accumulates_the_gradients_of_the_whole_batch(mesh, defer: bool):
    # rl.waves: forward_backward once per part, `final` only on the last; with deferred sync nothing is reduced
    # before the step's last micro-batch, and the sum is that of one call over every micro-batch
    model = apply_fsdp(build_model(ARGS, seed=7), mesh, torch.float32, torch.float32)
    seen: list[bool] = []

    def loss_fn(logp, ent, mb):
        seen.append(any(p.grad is not None for p in model.model.layers[0].parameters()))
        return logp.sum(), 1

    micro = [batch(seed=i) for i in range(4)]
    dev = torch.device("cpu")
    whole = forward_backward(model, micro, loss_fn, 1.0, None, dev, defer_grad_sync=defer)
    grads = [p.grad.full_tensor().clone() for p in model.parameters()]
    model.zero_grad()
    seen.clear()
    first = forward_backward(model, micro[:1], loss_fn, 1.0, None, dev, defer_grad_sync=defer, final=False)
    second = forward_backward(model, micro[1:], loss_fn, 1.0, None, dev, defer_grad_sync=defer, final=True)
    assert seen == [False, not defer, not defer, not defer]
    assert first + second == whole == [1] * 4  # each micro-batch's statistics, once
    for a, p in zip(grads, model.parameters()):
        torch.testing.assert_close(a, p.grad.full_tensor(), rtol=1e-5, atol=1e-6)
