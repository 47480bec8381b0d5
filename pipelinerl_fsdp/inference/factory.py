"""Build this inference rank's engine (of the kind `inference.engine` names, see `engine_kinds.py`) from the job's
inputs; or the same engine outside a job, generating only, for the tools and benchmarks that measure it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipelinerl_fsdp.config import InferenceConfig, JobConfig, WorldConfig
from pipelinerl_fsdp.engine_kinds import EngineKind, engine_kind, load_named

if TYPE_CHECKING:
    from pipelinerl_fsdp.inference.engine import Engine
    from pipelinerl_fsdp.job.world import World
    from pipelinerl_fsdp.job_inputs import JobInputs
    from pipelinerl_fsdp.transport.weights import WeightReceiver


def engine_class(kind: EngineKind) -> type[Engine]:
    """The class `kind.impl` names, imported now (an engine's package loads only when one starts)."""
    return load_named(kind.impl)


def build_engine(
    inference: InferenceConfig,
    job: JobConfig,
    world_cfg: WorldConfig,
    world: World,
    inputs: JobInputs,
) -> tuple[Engine, WeightReceiver]:
    """Start this inference rank's engine and the receiver of weight updates (collective with the first trainer
    rank where the engine's workers join the bucket group)."""
    import torch

    from pipelinerl_fsdp.inference.engine import EngineSettings

    kind = engine_kind(inference)
    # an engine in its own processes picks its device itself: the rank's process is on CPU, vLLM's on the GPU
    on_gpu = inputs.weight_sync.engines_on_gpu
    device = torch.device("cuda" if on_gpu else "cpu") if kind.own_processes else world.device
    settings = EngineSettings(
        inference=inference,
        timeout_s=world_cfg.timeout_s,
        debug=job.debug,
        threads_per_rank=job.threads_per_rank,
        world=world,
        model_path=inputs.model_path,
        tokenizer_path=inputs.tokenizer_path,
        max_len=inputs.engine_max_len,
        stop_token_ids=inputs.stop_ids,
        dtype=inputs.weight_sync.dtype,
        device=device,
        seed=job.seed * 1000 + world.rank,
        bucket_bytes=world_cfg.weight_bucket_mb * 1024**2,
        bucket_group_size=inputs.weight_sync.bucket_group_size,
        lora=inputs.weight_sync.lora,
    )
    return engine_class(kind).create(settings)


def generation_engine(
    inference: InferenceConfig,
    job: JobConfig,
    world_cfg: WorldConfig,
    model_path: str,
    max_len: int,
    stop_token_ids: list[int],
    *,
    cores: str | None = None,
    device: str = "cpu",
    seed: int | None = None,
) -> Engine:
    """The engine of the kind `inference.engine` names, built from the config's sections as an inference rank
    builds its own, but outside a job: no weight updates. An engine in its own processes (vLLM) runs on `cores`
    (CPU) or GPU 0; one in this process on this process's threads. `seed` defaults to `job.seed`; the tokenizer is
    the model folder's."""
    import torch

    from pipelinerl_fsdp.inference.engine import EngineSettings
    from pipelinerl_fsdp.job.weight_sync import engine_dtype

    dev = torch.device(device)
    settings = EngineSettings(
        inference=inference,
        timeout_s=world_cfg.timeout_s,
        debug=job.debug,
        threads_per_rank=job.threads_per_rank,
        world=None,
        model_path=str(model_path),
        tokenizer_path=str(model_path),
        max_len=max_len,
        stop_token_ids=stop_token_ids,
        dtype=engine_dtype(inference.dtype, dev),
        device=dev,
        seed=job.seed if seed is None else seed,
        bucket_bytes=0,
        bucket_group_size=0,
        cores=cores,
    )
    return engine_class(engine_kind(inference)).open(settings)
