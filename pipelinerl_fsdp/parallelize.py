"""FSDP2 sharding of the decoder (per block, then the root) and gathering the full weights back."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from pipelinerl_fsdp.models.decoder import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_param_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' means fp32 on CPU (bf16 matmuls are slow there and tests compare in fp32), bf16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def apply_fsdp(
    model: Transformer, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> Transformer:
    """Shard each decoder block, then the root (embeddings, final norm, lm_head)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


@torch.no_grad()
def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor on every rank (a collective: all FSDP ranks must call it)."""
    out = {}
    for name, t in model.state_dict().items():
        out[name] = t.full_tensor() if isinstance(t, DTensor) else t
    return out
