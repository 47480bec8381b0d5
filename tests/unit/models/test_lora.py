"""LoRA adapters on the decoder: the adapted forward against the merged weights, which parameters learn, the
initial values PEFT gives, the layout both ends of a push build."""

from __future__ import annotations

import math

import pytest
import torch

from pipelinerl_fsdp.config import LoRAConfig
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.models.lora import (
    LoRALinear,
    adapted_weight_name,
    adapter_layout,
    adapter_parameters,
    apply_lora,
    init_adapters,
    merge_adapters,
    merged_weight,
)


def _model(seed: int = 0) -> torch.nn.Module:
    return build_model(flavour_args("debug"), seed=seed)


def _randomise_adapters(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def test_adapted_forward_equals_the_forward_with_merged_weights():
    cfg = LoRAConfig(enabled=True, rank=4, alpha=8.0)
    model = _model()
    apply_lora(model, cfg)
    _randomise_adapters(model, 1)  # B = 0 would make the two trivially equal
    plain = _model()
    plain.load_state_dict(merge_adapters(model.state_dict(), cfg))
    ids = torch.randint(0, model.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        adapted, merged, base = model(ids), plain(ids), _model()(ids)
    # fp32, different order of operations (x W^T + s x A^T B^T against x (W + s B A)^T)
    torch.testing.assert_close(adapted, merged, atol=2e-5, rtol=1e-4)
    assert (adapted - base).abs().max() > 1e-3  # the adapters do change the output


def test_gradients_reach_only_the_adapters():
    cfg = LoRAConfig(enabled=True, rank=2, target_modules=["q_proj", "down_proj"])
    model = _model()
    apply_lora(model, cfg)
    init_adapters(model, seed=0)
    ids = torch.randint(0, model.args.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    model(ids).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        if ".lora_" in name:
            assert p.requires_grad and p.grad is not None, name
        else:
            assert not p.requires_grad and p.grad is None, name
    grads = dict((n, p.grad) for n, p in adapter_parameters(model))
    # at PEFT's init B = 0: A's gradient (through B) is exactly zero, B's is not
    assert all(g.abs().max() == 0 for n, g in grads.items() if ".lora_A." in n)
    assert all(g.abs().max() > 0 for n, g in grads.items() if ".lora_B." in n)
    assert {n.split(".")[-3] for n in grads} == {"q_proj", "down_proj"}


def test_initial_adapters_are_pefts_and_the_same_on_every_call():
    cfg = LoRAConfig(enabled=True, rank=8)
    a, b = _model(), _model()
    for m in (a, b):
        apply_lora(m, cfg)
        init_adapters(m, seed=5)
    for (name, p), (_, q) in zip(adapter_parameters(a), adapter_parameters(b)):
        assert torch.equal(p, q), name
        if ".lora_B." in name:
            assert p.abs().max() == 0
        else:  # Kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
            bound = 1 / math.sqrt(p.shape[1])
            assert p.abs().max() <= bound and p.abs().max() > 0.8 * bound and p.std() > 0.4 * bound
    init_adapters(b, seed=6)
    assert not torch.equal(adapter_parameters(a)[0][1], adapter_parameters(b)[0][1])


def test_the_layout_is_the_adapted_models_push_order():
    cfg = LoRAConfig(enabled=True, rank=3, target_modules=["v_proj", "up_proj"])
    model = _model()
    apply_lora(model, cfg)
    layout = adapter_layout(model.args, cfg)
    assert layout == [(n, p.shape) for n, p in adapter_parameters(model)]
    args = model.args
    kv = args.num_key_value_heads * (args.head_dim or args.hidden_size // args.num_attention_heads)
    assert dict(layout)["model.layers.0.self_attn.v_proj.lora_A.weight"] == (3, args.hidden_size)
    assert dict(layout)["model.layers.0.self_attn.v_proj.lora_B.weight"] == (kv, 3)
    assert len(layout) == 2 * 2 * args.num_hidden_layers


def test_base_names_are_unchanged_and_merging_restores_the_plain_state_dict():
    cfg = LoRAConfig(enabled=True, rank=2)
    model = _model()
    plain_keys = set(_model().state_dict())
    apply_lora(model, cfg)
    assert {k for k in model.state_dict() if ".lora_" not in k} == plain_keys
    assert set(merge_adapters(model.state_dict(), cfg)) == plain_keys
    assert isinstance(model.model.layers[0].mlp.gate_proj, LoRALinear)
    assert adapted_weight_name("model.layers.3.mlp.up_proj.lora_B.weight") == "model.layers.3.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="not an adapter"):
        adapted_weight_name("model.layers.3.mlp.up_proj.weight")


def test_merged_weight_is_w0_plus_scaled_ba_in_w0s_dtype():
    """W0 + s B A summed in fp32 and rounded once to bf16: each element within half a bf16 ulp of the fp64 sum
    (plus the fp32 sum's own error, 2^-20 of the terms' size); the same merge computed in bf16 (B A rounded, then
    the sum rounded) is not."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    a, b = torch.randn(4, 48, generator=g), torch.randn(64, 4, generator=g)
    out = merged_weight(w0, a, b, 4.0)
    assert out.dtype == torch.bfloat16
    exact = w0.double() + 4.0 * (b.double() @ a.double())
    _, exponent = torch.frexp(exact)  # |exact| in [2^(e-1), 2^e): a bf16 ulp there is 2^(e-8)
    bound = torch.ldexp(torch.ones_like(exact), exponent - 9) + 2**-20 * (w0.double().abs() + 4.0 * (b.abs() @ a.abs()))
    assert ((out.double() - exact).abs() <= bound).all()
    in_bf16 = torch.addmm(w0, b.bfloat16(), a.bfloat16(), alpha=4.0)
    assert ((in_bf16.double() - exact).abs() > bound).any()


def test_scaling_is_alpha_over_rank_or_over_its_root():
    assert LoRAConfig(rank=16, alpha=32).scaling == 2.0
    assert LoRAConfig(rank=16, alpha=32, use_rslora=True).scaling == 8.0
