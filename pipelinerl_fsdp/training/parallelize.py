"""FSDP2 sharding of the decoder (per block, then the root) and gathering the full weights back."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class HeadPrecision:
    """How the FSDP root (embeddings, final norm, lm_head) computes: the dtype its parameters are gathered in,
    and whether the logits are rounded to that dtype (else the head's products return fp32 logits whatever the
    operands' dtype: `models.logprobs.fp32_product`)."""

    root_dtype: torch.dtype
    round_logits: bool = False


def resolve_fp32_head(setting: str, param_dtype: torch.dtype) -> HeadPrecision:
    """`trainer.fp32_head`: "on": the root gathered and computed in fp32 (fp32 weights, fp32 GEMMs); "auto": the
    root in `param_dtype`, the head's products on its operands with fp32 accumulation and fp32 logits (under
    bf16: tensor-core GEMMs, logits never rounded to bf16); "off": as "auto", but the logits rounded to
    `param_dtype` (the control that shows what that rounding costs). With fp32 parameters all three are fp32."""
    if setting == "on":
        return HeadPrecision(torch.float32)
    return HeadPrecision(param_dtype, round_logits=setting == "off")


# device types on which compiled blocks were measured faster than eager ones (what "auto" compiles on)
MEASURED_FASTER_COMPILED: frozenset[str] = frozenset()


def resolve_compile(setting: str, device: torch.device) -> bool:
    """`trainer.compile`: "auto" compiles on the devices where compiled blocks were measured faster than eager ones
    (`benchmarks/rl_step_speed.py --compile on|off`; on a GPU the GPU check's `rl_step_05b` against
    `rl_step_05b_eager`): none yet. On a GPU the eager block is a string of small kernels the host launches one by
    one, so compiling is expected to pay there, but it has not run on one; on CPU it is not measured faster."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"trainer.compile = {setting!r}: one of 'auto', 'on', 'off'")
    return setting == "on" or (setting == "auto" and device.type in MEASURED_FASTER_COMPILED)


def apply_compile(model: Transformer) -> int:
    """`torch.compile` each decoder block's parts around attention (`DecoderLayer.pre_attention`, `post_attention`:
    the norms, the residuals, the MLP), `fullgraph=True`, before FSDP wraps the blocks, as TorchTitan compiles per
    block: every block runs the same code, so one compiled graph serves them all. Attention stays eager: its
    per-document loop depends on how the micro-batch is packed, which a graph would specialise on. Parameter
    names do not change (the compiled functions are attributes, not modules). Returns the blocks compiled."""
    for layer in model.model.layers:
        layer.pre_attention = torch.compile(layer.pre_attention, fullgraph=True)
        layer.post_attention = torch.compile(layer.post_attention, fullgraph=True)
    return len(model.model.layers)


def apply_fsdp(
    model: Transformer,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    head: HeadPrecision | None = None,
) -> Transformer:
    """Shard each decoder block, then the root (embeddings, final norm, lm_head), whose parameters are gathered
    in `head.root_dtype` (default: `param_dtype`, fp32 logits); the blocks still cast their inputs to
    `param_dtype`. The final norm computes in fp32 internally either way."""
    head = head or HeadPrecision(param_dtype)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    model.round_logits = head.round_logits
    root = MixedPrecisionPolicy(param_dtype=head.root_dtype, reduce_dtype=reduce_dtype)
    fully_shard(model, mesh=mesh, mp_policy=root)
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
