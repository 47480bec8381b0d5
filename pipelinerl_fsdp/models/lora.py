"""Low-rank adapters (LoRA) on the decoder's linears, in PEFT's layout: a targeted `nn.Linear` keeps its frozen
`weight` (and bias) under the same name and gains `lora_A` [rank, in] and `lora_B` [out, rank] submodules, so a
parameter is named `model.layers.N.self_attn.q_proj.lora_A.weight`: PEFT's key without its `base_model.model.`
prefix. The adapted linear computes W x + s B A dropout(x), s = `LoRAConfig.scaling`; its merged weight is
W + s B A (`merged_weight`, the one formula the engines, the merged export and the tests use)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from pipelinerl_fsdp.config.lora import LoRAConfig
from pipelinerl_fsdp.models.args import ModelArgs
from pipelinerl_fsdp.models.decoder import Transformer

ADAPTER_PARTS = (".lora_A.", ".lora_B.")
# the submodule of a decoder layer that holds each target
_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


class LoRALinear(nn.Linear):
    """`nn.Linear` plus a low-rank update: y = x W^T + b + s (dropout(x) A^T) B^T. The base `weight`/`bias` keep
    their names, so HF loading, the memory plan and the base's checkpoints see the same parameters as without."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the base tensors themselves, not copies
        kw = {"device": base.weight.device, "dtype": torch.float32}  # adapters are fp32 master weights
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)
        self.scaling = scaling
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapted = True  # False inside `adapters_disabled`: the base linear alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        if not self.adapted:
            return base
        update = self.lora_B(self.lora_A(self.drop(x).to(self.lora_A.weight.dtype)))
        return base + (self.scaling * update).to(base.dtype)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every `LoRALinear` of `model` computes its base linear alone: the model is the frozen base. The KL
    reference under LoRA is the policy run this way (no second copy of the base); a model without adapters is
    unchanged."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.adapted = False
    try:
        yield
    finally:
        for m in layers:
            m.adapted = True


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter factor (`...lora_A.weight` / `...lora_B.weight`)."""
    return any(part in name for part in ADAPTER_PARTS)


def adapted_weight_name(adapter_name: str) -> str:
    """The base weight an adapter factor belongs to: `...q_proj.lora_A.weight` -> `...q_proj.weight`."""
    for part in ADAPTER_PARTS:
        if part in adapter_name:
            return adapter_name.split(part)[0] + ".weight"
    raise ValueError(f"{adapter_name} is not an adapter parameter")


def apply_lora(model: Transformer, cfg: LoRAConfig) -> list[str]:
    """Swap the targeted linears of every decoder layer for `LoRALinear`s (on the device their weights are on:
    the meta device before sharding is fine) and freeze everything else. Returns the adapted modules' names.
    The adapters are uninitialised on the meta device: `init_adapters` after `to_empty`."""
    adapted = []
    for i, layer in enumerate(model.model.layers):
        for target in cfg.target_modules:
            parent = getattr(layer, _PARENT[target])
            base = getattr(parent, target)
            setattr(parent, target, LoRALinear(base, cfg.rank, cfg.scaling, cfg.dropout))
            adapted.append(f"model.layers.{i}.{_PARENT[target]}.{target}")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    model.lora = cfg  # type: ignore[attr-defined]  # what exports and the engines' layout read back
    return adapted


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapter factors in `named_parameters()` order: what the optimizer, checkpoints and pushes carry."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]


def adapter_layout(args: ModelArgs, cfg: LoRAConfig) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every adapter factor of a model of `args`, in the trainer's push order: both ends of the
    in-flight update build it the same way (on the meta device, no memory)."""
    with torch.device("meta"):
        model = Transformer(args)
    apply_lora(model, cfg)
    return [(n, p.shape) for n, p in adapter_parameters(model)]


def full_adapter_init(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """PEFT's initial value of one factor, identical on every rank: A Kaiming-uniform (a = sqrt 5, i.e. uniform in
    +-1/sqrt(in)), B zero (so the adapted model starts as the base). Seeded by `seed` and the name."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=gen)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Give every adapter factor its initial value (`full_adapter_init`): after `to_empty`, sharded or not (a
    DTensor takes its own rows of the full value, which every rank computes the same)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, p in adapter_parameters(model):
        full = full_adapter_init(name, p.shape, seed)
        if isinstance(p, DTensor):
            local = p.to_local()
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            if local.numel():
                local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
        else:
            p.copy_(full)


def merged_weight(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W0 + s B A, computed in fp32 and returned in W0's dtype: the adapted linear's weight, from the base the
    caller keeps (so merging version after version never accumulates rounding). One fused `addmm`: the engines
    merge every targeted weight at each update, inside the pause, and the unfused sum read and wrote each
    weight-sized tensor about three times more."""
    return torch.addmm(w0.float(), b.float(), a.float(), alpha=scaling).to(w0.dtype)


def merge_adapters(
    state: dict[str, torch.Tensor], cfg: LoRAConfig, keep_adapters: bool = False
) -> dict[str, torch.Tensor]:
    """A full state dict of an adapted model with every adapted weight merged (`merged_weight`) and, unless
    `keep_adapters`, the factors dropped: the plain model's state dict."""
    out = dict(state)
    for name in [n for n in state if ".lora_A." in n]:
        target = adapted_weight_name(name)
        out[target] = merged_weight(
            state[target], state[name], state[name.replace(".lora_A.", ".lora_B.")], cfg.scaling
        )
    return out if keep_adapters else {k: v for k, v in out.items() if not is_adapter(k)}
