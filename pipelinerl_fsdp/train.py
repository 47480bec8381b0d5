"""Entry point: load the config, join the torchrun world, run this job's stage on this rank."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback

import torch

from pipelinerl_fsdp.config import Config, ConfigError, InferenceConfig, JobConfig, save_resolved
from pipelinerl_fsdp.configure import load_config, named_source, validate_world
from pipelinerl_fsdp.job.world import World, init_world, job_flags, shutdown, wait_for_flag
from pipelinerl_fsdp.runtime import stopping
from pipelinerl_fsdp.runtime.gpus import smallest_gpu_gib
from pipelinerl_fsdp.runtime.processes import kill_descendants
from pipelinerl_fsdp.runtime.stopping import StopRequested


def run_rl(cfg: Config, world: World) -> None:
    """Warm start (trainer ranks, if its folder is missing) unless model.path is given, then PipelineRL."""
    from pipelinerl_fsdp.inference.worker import run_inference
    from pipelinerl_fsdp.training.rl_trainer import run_trainer
    from pipelinerl_fsdp.training.warmstart import run_warmstart

    path = cfg.model.path
    if not path:
        if world.is_trainer:
            threads = torch.get_num_threads()
            if not cfg.job.threads_per_rank:  # the engines idle meanwhile: let the trainers use their cores
                torch.set_num_threads(
                    max(
                        1,
                        (os.cpu_count() or 1) * world.world_size // (world.local_world_size * len(world.trainer_ranks)),
                    )
                )
            try:
                run_warmstart(cfg, world)
            except BaseException as e:  # the engines wait for the warm start: tell them at once, with the cause
                cause = f"rank {world.rank}, warm start: {type(e).__name__}: {e}"
                try:
                    job_flags(cfg.world.timeout_s).set("warmstart_failed", cause)
                except Exception:  # noqa: BLE001 (the store may be gone; torchrun's SIGTERM then ends the others)
                    pass
                raise
            torch.set_num_threads(threads)
            if world.is_main:
                job_flags(cfg.world.timeout_s).set("warmstart_done", "1")
        else:
            # The warm start may take longer than any collective's time-out: wait on the job's store instead, in
            # short checks, so a failed trainer (its cause on the store) or torchrun's SIGTERM ends this rank at once.
            wait_for_flag(job_flags(cfg.world.timeout_s), "warmstart_done", "warmstart_failed")
        path = cfg.warmstart.path
    from pipelinerl_fsdp.job_inputs import build_job_inputs

    inputs = build_job_inputs(cfg, path, world)  # every rank, before any engine starts
    bind_cpu_cores(cfg.job, cfg.inference, world)
    bucket = cfg.world.weight_bucket_mb * 1024**2
    if world.is_trainer:
        run_trainer(cfg, world, inputs, bucket)
    else:
        run_inference(cfg, world, inputs, bucket)


def bind_cpu_cores(job: JobConfig, inference: InferenceConfig, world: World) -> None:
    """CPU jobs (`job.bind_cores`): bind every thread of this rank (gloo's I/O loops included), and what it starts
    from now on (vLLM, reward workers), to its cores; after the warm start, which lets the trainers use every core
    while the engines wait."""
    from pipelinerl_fsdp.inference.placement import rank_cores
    from pipelinerl_fsdp.runtime import cpu_binding

    if world.backend == "nccl" or not job.bind_cores:
        return
    cores = rank_cores(inference, job.threads_per_rank, world)
    if cores and cpu_binding.bind(cores) and not job.threads_per_rank:
        torch.set_num_threads(len(cores))


def run(cfg: Config) -> None:
    from pipelinerl_fsdp.tasks import task_class

    # every rank, before the world forms: a bad data file fails them all at once (the warm start reads it on the
    # trainer ranks only, while the others wait for it)
    task_class(cfg.task.name).check_files(cfg.task)

    def decide_trainer_keys(n_trainers: int, on_gpu: bool) -> None:
        """The trainer's "auto" keys decided by its device (plan.resolve_trainer_defaults), before any use."""
        from pipelinerl_fsdp.plan import GIB, resolve_trainer_defaults

        sync = {"engine_dtype": cfg.inference.dtype, "bucket_mb": cfg.world.weight_bucket_mb, "lora": cfg.lora}
        gpu = gpu_gib * GIB
        resolve_trainer_defaults(
            cfg.trainer, cfg.model, n_trainers, on_gpu, gpu, kl_reference=cfg.rl.kl_coef > 0, **sync
        )

    def decide_engine_base(on_gpu: bool) -> None:
        """`lora.engine_base` "auto" decided by the engines' device and memory plan (plan.resolve_engine_base)."""
        from pipelinerl_fsdp.plan import resolve_engine_base
        from pipelinerl_fsdp.plan_sizes import plan_model_args

        if not (cfg.lora.enabled and on_gpu):
            resolve_engine_base(cfg.lora, on_gpu=False)
            return
        args = (cfg.inference, plan_model_args(cfg.model)[0], gpu_gib, cfg.world.weight_bucket_mb)
        resolve_engine_base(cfg.lora, True, *args, cfg.rl.mode == "async")

    # the "auto" keys plan for plan.gpu_memory_gib, or the smallest GPU the job found where that is less (a plan
    # for 80 GiB must not run on 40 GiB cards)
    gpu_gib = cfg.plan.gpu_memory_gib
    if cfg.job.stage == "rl" and cfg.rl.mode == "colocated":  # one process, no torchrun world
        from pipelinerl_fsdp.training.colocated import colocated_device, run_colocated

        device = colocated_device(cfg.job)
        if device.type == "cuda":
            gpu_gib = min(gpu_gib, torch.cuda.get_device_properties(device).total_memory / 2**30)
        decide_trainer_keys(1, on_gpu=device.type == "cuda")
        run_colocated(cfg)
        return
    world = init_world(cfg)
    validate_world(cfg, world.world_size)
    if world.backend == "nccl":  # every rank, collectively: the same value everywhere
        cuda = world.device.type == "cuda"  # a vLLM rank's device is the CPU: it never touches CUDA
        own = torch.cuda.get_device_properties(world.device).total_memory / 2**30 if cuda else None
        gpu_gib = min(gpu_gib, smallest_gpu_gib(own))
        if world.is_main and gpu_gib < cfg.plan.gpu_memory_gib:
            print(f"[plan] 'auto' keys sized for the smallest GPU found, {gpu_gib:.1f} GiB (plan.gpu_memory_gib = "
                  f"{cfg.plan.gpu_memory_gib:g})", flush=True)  # fmt: skip
    decide_trainer_keys(len(world.trainer_ranks), on_gpu=world.backend == "nccl")
    decide_engine_base(on_gpu=world.backend == "nccl" and cfg.inference.engine == "vllm")  # vLLM on its GPUs
    if world.is_main:  # the resolved config, "auto" keys decided
        save_resolved(cfg, cfg.job.output_dir)
    if cfg.job.stage == "warmstart":
        from pipelinerl_fsdp.training.warmstart import run_warmstart

        if world.is_trainer:
            run_warmstart(cfg, world)
    elif cfg.job.stage == "rl":
        run_rl(cfg, world)
    if stopping.requested() is None:
        shutdown()
    # else a stop arrived after the last step: the engines are gone and the rollout receiver may still be blocked
    # in a receive on its group; destroying the groups under it gains nothing, the process exits at once (main)


def main(argv: list[str] | None = None) -> int:
    # a native crash (SIGSEGV, SIGABRT from a corrupted heap, ...) prints every Python thread's stack before the
    # rank dies, so the log says which thread was where
    faulthandler.enable(all_threads=True)
    # Until the trainer loop takes over (graceful stop, see stopping.py), a signal stops this rank at once:
    # checkpoints already written are complete (a save cut short is never resumed from).
    stopping.install(graceful=False, on_exit=kill_descendants)
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    if cfg.job.stage == "plan":
        from pipelinerl_fsdp.plan import make_plan

        try:
            with named_source(cfg.source):
                text, problems = make_plan(cfg)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr, flush=True)
            return 2
        print(text, flush=True)
        if cfg.plan.predict:
            from pipelinerl_fsdp.plan_performance import performance_plan

            c = cfg
            print(
                performance_plan(c.plan, c.model, c.rl, c.inference, c.task, c.trainer, c.world.inference_ranks),
                flush=True,
            )
        return 1 if problems else 0
    try:
        with named_source(cfg.source):  # a ConfigError raised by any stage names where the values came from
            run(cfg)
    except StopRequested as e:
        print(f"[rank {os.environ.get('RANK', '0')}] {e}", flush=True)
        kill_descendants()
        os._exit(128 + e.signum)
    except BaseException as e:
        # Print the cause with the rank, then exit at once: a clean shutdown could block on collectives or
        # threads that wait for peers, and torchrun tears the other ranks down as soon as this one is gone.
        rank = os.environ.get("RANK", "0")
        stop = stopping.requested()
        if isinstance(e, ConfigError):
            print(f"[rank {rank}] config error: {e}", file=sys.stderr, flush=True)
        elif stop is not None:  # a peer that the same stop took down first: not this rank's failure
            print(f"[rank {rank}] stopped by {signal.Signals(stop).name} ({type(e).__name__}: {e})", flush=True)
            kill_descendants()
            os._exit(128 + stop)
        else:
            print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        kill_descendants()
        os._exit(2 if isinstance(e, ConfigError) else 1)
    # Every output is written and every group destroyed: skip the interpreter's teardown, where C++ destructors
    # of torch/gloo threads occasionally aborted a finished rank ("terminate called without an active
    # exception", seen once in ~10 runs of a 3-rank job), turning a completed run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
