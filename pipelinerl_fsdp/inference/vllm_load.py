"""Loading a weight update into a running vLLM model in place (runs inside vLLM's worker process).

Three ways, `inference.vllm_weight_load` ("auto": `resolve_weight_load`):

- "reload": vLLM's `reload_weights`. Generic (quantised models too): it puts every layer back on the meta
  device, buffers each layer's tensors until the layer is complete (counting elements with a dispatch mode),
  materialises it, loads it, runs the layer's post-load processing and copies the result into the old storage.
  On CPU that processing repacks every linear weight into a oneDNN handle and drops the plain weight.
- "inplace": the model's own `load_weights` (what PipelineRL and verl call): each tensor is copied into its
  parameter as it arrives (q/k/v and gate/up fused by vLLM's loaders). On GPU nothing else is needed for an
  unquantised model. On CPU the linears' plain weights are kept (given back once, at the first update) and every
  linear is repacked after the load: the repack stays, the machinery goes.
- "unpacked" (CPU only; elsewhere the same as "inplace"): as "inplace", but the CPU linears compute with
  `torch.nn.functional.linear` on the plain weight, so an update is copies only and nothing is repacked. For
  small hidden sizes oneDNN's packed kernels gain nothing at decode batch sizes (docs/weight_sync.md).

The plain weights "inplace"/"unpacked" keep on CPU cost one more copy of the linear weights in the worker.

On GPU vLLM captures CUDA graphs at start-up, over the addresses of the weights as they were then: an update
must copy into that storage. Both ways do (vLLM 0.32: every `weight_loader` of `layers/linear.py` and
`layers/vocab_parallel_embedding.py`, and `default_weight_loader`, `param.data.copy_` into the parameter or a
`narrow`ed slice of it; `reload` copies each processed layer back into the storage it saved,
`reload/layerwise.py`, `_copy_and_restore_kernel_tensors`); a loader that rebinds a parameter instead would leave
the graphs replaying the old weights, silently. `WeightAddresses` checks it after every update.
"""

from __future__ import annotations

import typing
from collections.abc import Collection, Iterable

import torch

from pipelinerl_fsdp.inference.vllm_config import WeightLoad

# the ways to load, as the vLLM section's `vllm_weight_load` key spells them ("auto" chooses one)
LOADS = tuple(a for a in typing.get_args(WeightLoad) if a != "auto")
# Widest hidden size for which "auto" computes CPU linears unpacked: at the 0.8M model (hidden 128) the engine
# generated as fast unpacked as packed (2,609 vs 2,615 tokens/s, 16 sequences), at the 75M model (hidden 768) 0.86x
# (202 vs 236), while an update's pause shrank 3.6x and 2.3x (`benchmarks/vllm_update.py`).
UNPACKED_MAX_HIDDEN = 256


def resolve_weight_load(load: str, hidden_size: int, on_gpu: bool) -> str:
    """`inference.vllm_weight_load` with "auto" decided: on GPU "inplace" (nothing to repack); on CPU "unpacked"
    for hidden sizes up to `UNPACKED_MAX_HIDDEN`, where packing gains nothing, else "inplace"."""
    if load != "auto":
        if load not in LOADS:
            raise ValueError(f"inference.vllm_weight_load: {load!r} is not one of {('auto', *LOADS)}")
        return load
    if on_gpu:
        return "inplace"
    return "unpacked" if hidden_size <= UNPACKED_MAX_HIDDEN else "inplace"


def graphs_captured(on_gpu: bool, enforce_eager: bool) -> bool:
    """Whether vLLM captured CUDA graphs over the weights' addresses (`enforce_eager` off on a GPU), so that an
    update that moves a parameter would go unseen by the graphs."""
    return on_gpu and not enforce_eager


class WeightAddresses:
    """Where every parameter of the served model lives (storage address, dtype, shape), taken once after start-up
    (the CUDA graphs are captured by then) and checked after each update: one pass over a dict, microseconds."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.taken = self._now()

    def _now(self) -> dict[str, tuple[int, torch.dtype, tuple[int, ...]]]:
        return {n: (p.data_ptr(), p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()}

    def check(self, version: int) -> None:
        """Fail, naming the parameters, when the update of `version` moved, re-typed, reshaped, added or dropped
        any: the captured graphs would go on computing with the old tensors."""
        now = self._now()
        changed = sorted(n for n in self.taken.keys() | now.keys() if self.taken.get(n) != now.get(n))
        if changed:
            was, got = self.taken.get(changed[0]), now.get(changed[0])
            raise RuntimeError(
                f"the weight update of version {version} left {len(changed)} of vLLM's parameters in other storage "
                f"than at start-up (e.g. {changed[:3]}; {changed[0]}: {was} -> {got}, as (address, dtype, shape)): "
                "the CUDA graphs captured then would keep replaying the old weights. Load in place "
                "(inference.vllm_weight_load), or run without graphs (inference.cuda_graphs = false)"
            )


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


class InPlaceLoader:
    """Loads updates with the model's `load_weights` ("inplace", "unpacked" above).

    `layers`: the modules every update loads, by the served model's names (fused: `...qkv_proj`), when an update
    carries only some linears (a LoRA push: the targeted ones, inference/lora_merge.py); None: every linear. Only
    those CPU linears get their plain weight back, are checked as loaded and are repacked: the others keep the
    kernels vLLM built at start-up, over the weights they still hold (a plain weight given back to a linear that
    no update fills would be uninitialised memory)."""

    def __init__(self, model: torch.nn.Module, unpacked: bool, layers: Collection[str] | None = None) -> None:
        self.model = model
        self.unpacked = unpacked
        if layers is not None:
            unknown = sorted(set(layers) - {name for name, _ in model.named_modules()})
            if unknown:
                raise ValueError(f"the updates would load {unknown[:3]}: no such module in the served model")
        # CPU layers whose linear runs through a kernel handle (`cpu_linear`, set by vLLM's CPU GEMM dispatch)
        self.cpu_layers = {
            name: m
            for name, m in model.named_modules()
            if hasattr(m, "cpu_linear") and (layers is None or name in layers)
        }
        self._ready = False  # plain weights restored (at the first load)
        self._restored: list[torch.nn.Module] = []  # the layers that got theirs back

    def _restore_plain_weights(self) -> None:
        """Give every CPU linear whose plain weight vLLM dropped after packing it a weight tensor again, built
        from the metadata vLLM recorded at load time (same class and weight loader). Its values are garbage
        until the load that follows fills it, so this runs inside a load, never between two."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        for name, layer in self.cpu_layers.items():
            if layer.weight.numel() > 0:
                continue  # kept by vLLM (embeddings, whose table doubles as the LM head)
            info = get_layerwise_info(layer)
            meta = info.restore_metadata[0].get("weight")
            if meta is None:
                raise RuntimeError(f"vLLM recorded no model-format weight for {name}: cannot load it in place")
            with info.restore_device:
                # the recorded weight loader is bound to a placeholder instead of the layer: bind it back
                layer.register_parameter("weight", restore_layer_refs(materialize_meta_tensor(meta), layer))
            self._restored.append(layer)
        self._ready = True

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every tensor of `weights` (checkpoint names and shapes) into the model, then make the CPU
        linears compute with the new values (repacked, or plain)."""
        if self.cpu_layers and not self._ready:
            self._restore_plain_weights()
        loaded = self.model.load_weights(weights)
        if not self.cpu_layers:
            return
        if loaded is None:
            raise RuntimeError(f"{type(self.model).__name__}.load_weights does not say what it loaded: use reload")
        # by storage, not name: a tied LM head shares the embedding's table and is loaded under the embedding's name
        loaded_ptrs = {self.model.get_parameter(n).data_ptr() for n in loaded}
        missing = sorted(n for n, layer in self.cpu_layers.items() if layer.weight.data_ptr() not in loaded_ptrs)
        if missing:  # their plain weight would be garbage (first load) or stale (only `layers` are checked)
            raise RuntimeError(f"the update left {len(missing)} linear weights unloaded, e.g. {missing[:3]}")
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for layer in self.cpu_layers.values():
            if self.unpacked:
                layer.cpu_linear = _linear
            else:
                dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    def release(self) -> None:
        """Put the CPU layers back as vLLM leaves them after a load (packed; the weights vLLM drops dropped again),
        so that vLLM's own `reload_weights` works on them."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for layer in self.cpu_layers.values():
            dispatch_cpu_unquantized_gemm(layer, remove_weight=any(layer is r for r in self._restored))
        self._ready, self._restored = False, []
