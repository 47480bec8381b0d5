"""Methods mixed into vLLM's worker class (`worker_extension_cls`), called by `AsyncLLM.collective_rpc`.

They run inside vLLM's worker process, between two engine steps (the engine core executes RPCs between steps,
and the client pauses its scheduler around them). Keep this module light: vLLM imports it in every worker.
"""

from __future__ import annotations

import logging

import torch

from pipelinerl_fsdp.transport.store_group import join_store_group
from pipelinerl_fsdp.transport.weights import BucketLayout, broadcast_bucket

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _drop_rotary_reload_warning(record: logging.LogRecord) -> bool:
    """Drop vLLM's "RotaryEmbedding: Failed to load weights" warning, logged on every reload. It is harmless: the
    rotary layer's only tensor is its cos/sin cache, a buffer computed from the config that no checkpoint holds;
    when a reload brings nothing for a layer, vLLM puts the layer's own tensors back (`_place_kernel_tensors`), so
    the cache stays as it was. Any other layer that fails to load still warns."""
    return not (record.getMessage() == "RotaryEmbedding: Failed to load weights")


class WeightUpdateExtension:
    """Receives the trainer's weight broadcast straight into this worker and loads it with vLLM's reload path."""

    def join_weight_group(
        self,
        host: str,
        port: int,
        base_rank: int,
        size: int,
        backend: str,
        timeout_s: float,
        names_and_shapes: list[tuple[str, list[int]]],
        dtype: str,
        bucket_bytes: int,
        group_name: str = "vllm_weights",
    ) -> None:
        """Join the bucket group as `base_rank + this worker's tensor-parallel rank`; allocate receive buffers."""
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._pl_layout = BucketLayout(
            [(n, torch.Size(s)) for n, s in names_and_shapes], getattr(torch, dtype), bucket_bytes
        )
        # Persistent receive buffers, one per bucket: vLLM's loader copies out of them during the reload.
        self._pl_buffers = [torch.empty(n, dtype=self._pl_layout.dtype, device=device) for n in self._pl_layout.sizes]
        logging.getLogger(RELOAD_LOGGER).addFilter(_drop_rotary_reload_warning)
        rank = base_rank + int(getattr(self, "rank", 0))
        self._pl_group = join_store_group(host, port, group_name, rank, size, backend, device, timeout_s)

    def receive_weight_update(self, load: bool = True) -> dict[str, int]:
        """Receive one update into the receive buffers and (unless `load` is false: see `load_received_weights`)
        load it. Returns, per scheduled request (vLLM's internal id), how many output tokens it had *before* the
        load: the exact version boundary, since no engine step runs during this call."""
        for flat in self._pl_buffers:
            broadcast_bucket(flat, self._pl_group, 0, raw=True)
        return self.load_received_weights() if load else {}

    def load_received_weights(self) -> dict[str, int]:
        """Load the last received update (per-request token counts before the load, as above)."""
        counts = {
            rid: sum(1 for t in state.output_token_ids if t >= 0)  # -1: async-scheduling placeholder
            for rid, state in self.model_runner.requests.items()
        }
        named = [v for b, flat in enumerate(self._pl_buffers) for v in self._pl_layout.views(b, flat)]
        # checkpoint format: HF names and shapes; vLLM fuses q/k/v and gate/up and repacks CPU weights itself.
        self.model_runner.reload_weights(weights_iterator=named, is_checkpoint_format=True)
        return counts
