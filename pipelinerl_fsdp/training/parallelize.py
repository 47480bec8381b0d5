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


def resolve_fp32_head(setting: str, param_dtype: torch.dtype) -> bool:
    """'auto': an fp32 head whenever the blocks compute in a lower precision."""
    return setting == "on" or (setting == "auto" and param_dtype != torch.float32)


def apply_fsdp(
    model: Transformer,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    fp32_head: bool = False,
) -> Transformer:
    """Shard each decoder block, then the root (embeddings, final norm, lm_head). With `fp32_head` the root's
    parameters are gathered and used in fp32 (the blocks still cast their inputs to `param_dtype`), so the final
    norm, the logits and the log-probs are fp32 computations on fp32 weights."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    root_dtype = torch.float32 if fp32_head else param_dtype
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=root_dtype, reduce_dtype=reduce_dtype))
    return model


def apply_activation_checkpointing(model: Transformer, mode: str, every: int) -> int:
    """Checkpoint every `every`-th decoder block when `mode` is "full" (none when "off"); returns how many."""
    n = 0
    for i, layer in enumerate(model.model.layers):
        layer.checkpointed = mode == "full" and i % every == 0
        n += layer.checkpointed
    return n


@torch.no_grad()
def full_state_dict(model: torch.nn.Module, keep: bool = True, on_cpu: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor (a collective: all FSDP ranks must call it), gathered one at a time.
    `keep` false: gather in step with the others but keep nothing (ranks that do not write the result); `on_cpu`:
    each full tensor moves to host memory as soon as it is gathered, so a GPU holds one full tensor at a time, not
    the whole model in fp32 (30.5 GB at 7B)."""
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out[name] = full.cpu() if on_cpu else full
        del full
    return out
