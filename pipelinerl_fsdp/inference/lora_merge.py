"""LoRA on the engine side: the engines merge the pushed adapter factors into weights of their own.

Under `[lora]` a push carries only the adapters (fp32 A [rank, in] and B [out, rank] of every targeted linear, in
`models.lora.adapter_layout` order: a module's lora_A, then its lora_B). The engine keeps W0, the base weights of the
targeted linears it started with, and loads W0 + s B A (`models.lora.merged_weight`) into the weights it serves,
always from W0, so version after version never accumulates rounding.

Why merge here rather than serve the adapters with vLLM's own LoRA (vllm 0.32, read from its source):
- with a LoRA config the CPU platform turns compilation off (`vllm/platforms/cpu.py`, `check_and_update_config`:
  `compilation_config.mode = CompilationMode.NONE`), and the CPU LoRA kernels gather a per-token copy of B on every
  call (`vllm/lora/ops/torch_ops/lora_ops.py`, `bgmv_expand`): decode slows down, while a merged model decodes as
  fast as the base;
- adapters load from a folder only (`vllm/lora/worker_manager.py`, `WorkerLoRAManager._load_adapter`): no public
  entry point for tensors, so every update would go through the disk (or a patch of vLLM's private loader);
- `reload_weights` drops every adapter (`vllm/v1/worker/lora_model_runner_mixin.py`, `reset_lora_state`);
- merged, "engine after a push == engine opened on the merged weights" holds bit for bit (one formula).
The cost is the W0 copy of the targeted linears per engine worker (all seven linears of a 7B model in bf16: 13 GB).

This module is torch-only: vLLM's workers import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from pipelinerl_fsdp.models.hf_io import read_tensors
from pipelinerl_fsdp.models.lora import adapted_weight_name, merged_weight

# vLLM's fused linears for the decoder family (`packed_modules_mapping` of its Llama / Qwen2 / Qwen3 classes)
VLLM_PACKED: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


def _leaf(weight_name: str) -> tuple[str, str]:
    """`model.layers.0.self_attn.q_proj.weight` -> (`model.layers.0.self_attn`, `q_proj`)."""
    module = weight_name.removesuffix(".weight")
    parent, _, leaf = module.rpartition(".")
    return parent, leaf


def fused_siblings(weight_name: str, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """The weights loaded into the same fused parameter as `weight_name` (itself included), in `packed` order:
    `...q_proj.weight` -> the q, k and v weights of its layer; a weight outside any fused group -> itself."""
    parent, leaf = _leaf(weight_name)
    for members in packed.values():
        if leaf in members:
            return [f"{parent}.{m}.weight" for m in members]
    return [weight_name]


def loaded_weights(adapter_names: Iterable[str], packed: Mapping[str, Sequence[str]]) -> list[str]:
    """The HF weights an update writes, for a stream of these adapter factors: each adapted weight and, where it
    is part of a fused group, its untargeted siblings (targets q and v: k too), in first-seen order."""
    out: dict[str, None] = {}
    for name in adapter_names:
        for w in fused_siblings(adapted_weight_name(name), packed):
            out[w] = None
    return list(out)


def fused_module_name(weight_name: str, packed: Mapping[str, Sequence[str]]) -> str:
    """The serving model's module that loads `weight_name`: `...self_attn.q_proj.weight` -> `...self_attn.qkv_proj`
    under vLLM's fusion; the HF module itself outside any fused group."""
    parent, leaf = _leaf(weight_name)
    for fused, members in packed.items():
        if leaf in members:
            return f"{parent}.{fused}"
    return f"{parent}.{leaf}"


def base_placement(engine_base: str, device: torch.device) -> tuple[torch.device, bool]:
    """(where an engine on `device` keeps W0, whether it pins it) for `lora.engine_base`: "device" beside the
    weights it serves; "host" in host memory, pinned where the engine is on a GPU (a pageable source would make
    each per-update copy to the GPU synchronous and staged). "auto" is decided before the engines start
    (`plan.resolve_engine_base`) and is refused here."""
    if engine_base == "device":
        return device, False
    if engine_base == "host":
        return torch.device("cpu"), device.type == "cuda"
    raise ValueError(f"lora.engine_base = {engine_base!r} reached an engine (decided values: 'device', 'host')")


# Pinned host memory comes from torch's caching host allocator, which rounds every allocation up to a power of two
# (torch 2.13 `ATen/core/CachingHostAllocator.h`, `allocate`: `PowerOf2Ceil(size)` below `pinned_max_round_threshold`,
# unlimited by default): pinned weight by weight, Qwen2.5-7B's W0 (12.15 GiB) would hold 22.97 GiB (gate/up/down are
# 136 MB each, rounded to 256). Packed into 1 GiB slabs it holds 13.0.
PIN_SLAB_BYTES = 1 << 30
_ALIGN = 256  # bytes: every tensor's offset in a slab (a multiple of any element size)


def slab_layout(nbytes: list[int], slab_bytes: int = PIN_SLAB_BYTES) -> tuple[list[int], list[tuple[int, int]]]:
    """(the slabs' sizes, (slab, byte offset) of each tensor): tensors of `nbytes` packed first fit, in order, into
    slabs of `slab_bytes`, each offset aligned to 256 bytes; a tensor larger than a slab gets a slab of its own, of
    the next power of two (every slab a power of two, so the allocator rounds nothing up)."""
    sizes: list[int] = []
    used: list[int] = []
    where: list[tuple[int, int]] = []
    for n in nbytes:
        need = -(-n // _ALIGN) * _ALIGN
        slab = next((i for i, (size, u) in enumerate(zip(sizes, used)) if size - u >= need), None)
        if slab is None:
            sizes.append(max(slab_bytes, 1 << max(need - 1, 0).bit_length()))
            used.append(0)
            slab = len(sizes) - 1
        where.append((slab, used[slab]))
        used[slab] += need
    return sizes, where


def pack_into_slabs(
    base: dict[str, torch.Tensor], pin: bool, slab_bytes: int = PIN_SLAB_BYTES
) -> dict[str, torch.Tensor]:
    """Copies of `base`'s tensors as views into host slabs (`slab_layout`), pinned when `pin`."""
    tensors = list(base.items())
    sizes, where = slab_layout([t.numel() * t.element_size() for _, t in tensors], slab_bytes)
    slabs = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in sizes]
    out = {}
    for (name, t), (i, offset) in zip(tensors, where):
        view = slabs[i][offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[name] = view
    return out


def place_base(base: dict[str, torch.Tensor], engine_base: str, device: torch.device) -> dict[str, torch.Tensor]:
    """W0 moved where `base_placement` keeps it for an engine on `device`: pinned W0 packed into slabs."""
    where, pin = base_placement(engine_base, device)
    return pack_into_slabs(base, pin=True) if pin else {n: t.to(where) for n, t in base.items()}


def read_base(
    folder: str | Path, names: Iterable[str], dtype: torch.dtype, device: torch.device, engine_base: str = "device"
) -> dict[str, torch.Tensor]:
    """W0 of `names` from an HF folder (the one the engine opened), in the engine's dtype, where an engine on
    `device` keeps it (`base_placement`): the weights the engine started with, as its loader cast them."""
    read = {n: t.to(dtype=dtype) for n, t in read_tensors(folder, list(names)).items()}
    return place_base(read, engine_base, device)


class AdapterMerge:
    """Turns a push of adapter factors into the merged weights to load.

    `base`: W0 of every weight an update writes (`loaded_weights`), kept unchanged for the engine's life, on the
    engine's device or in (pinned) host memory: each W0 is moved to the device the factors arrive on as it is used.
    `adapter_names`: the factors a push carries (the receive layout's names). `packed`: the serving model's fused
    groups (vLLM: `VLLM_PACKED`; an unfused engine: none). A fused parameter is loaded slice by slice; a slice
    whose weight has no adapter is loaded with its W0 beside the merged ones, so an in-place load that first gives
    the fused parameter fresh (uninitialised) storage leaves no slice unwritten.
    """

    def __init__(
        self,
        base: dict[str, torch.Tensor],
        scaling: float,
        adapter_names: Iterable[str],
        packed: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        names = list(adapter_names)
        self.base, self.scaling, self.packed = base, scaling, dict(packed or {})
        self.targets = {adapted_weight_name(n) for n in names}
        self.writes = loaded_weights(names, self.packed)
        missing = [w for w in self.writes if w not in base]
        if missing:
            raise ValueError(f"adapter merge: no base weight for {missing[:3]} ({len(missing)} in all)")

    def __call__(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(adapter name, tensor) pairs in layout order (a module's lora_A, then its lora_B) -> (HF weight name,
        weight) pairs: each adapted weight as `merged_weight(W0, A, B, scaling)`, and after the first weight of a
        fused group its untargeted siblings' W0 (the stored tensor itself where it is on that device: loaders copy
        it). The received tensors may be views of a reused buffer: A is read by the time its B arrives (both in one
        bucket: buckets hold whole layers), and nothing yielded aliases them."""
        a: tuple[str, torch.Tensor] | None = None
        done: set[str] = set()  # weights yielded by this update
        for name, t in pairs:
            if ".lora_A." in name:
                if a is not None:
                    raise ValueError(f"adapter push: {a[0]} is not followed by its lora_B")
                a = (name, t)
                continue
            target = adapted_weight_name(name)
            if a is None or adapted_weight_name(a[0]) != target:
                raise ValueError(f"adapter push: {name} does not follow its lora_A (got {a and a[0]})")
            # W0 kept in host memory (`lora.engine_base = "host"`) comes to the factors' device one weight at a time
            w0 = self.base[target].to(t.device, non_blocking=True)
            yield target, merged_weight(w0, a[1], t, self.scaling)
            done.add(target)
            a = None
            for sibling in fused_siblings(target, self.packed):
                if sibling not in done and sibling not in self.targets:
                    done.add(sibling)
                    yield sibling, self.base[sibling].to(t.device, non_blocking=True)
        if a is not None:
            raise ValueError(f"adapter push: {a[0]} ends the update without its lora_B")
