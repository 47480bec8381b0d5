"""`--job.stage=plan`: the layout as the job places ranks, memory items that react to the settings they name, the
per-token activation count against what autograd really keeps for our block, and the verdict on math.toml."""

from __future__ import annotations

import pytest
import torch

from pipelinerl_fsdp.config import ConfigError
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.models.decoder import Documents, rope_cos_sin
from pipelinerl_fsdp.plan import GIB, block_activation_elements, layout, make_plan, trainer_memory

MATH_7B = ["--config", "math", "--job.stage=plan", "--model.flavour=qwen2.5-7b"]


def test_math_toml_fits_80gb_and_would_not_without_checkpointing():
    text, problems = make_plan(load_config(MATH_7B))
    assert problems == [], text
    assert "| 0-9 | 8 | 0 (x1) | 8 of 8 |" in text and "| 10-15 | 0 | 8 (x1) | 8 of 8 |" in text
    _, problems = make_plan(load_config([*MATH_7B, "--trainer.activation_checkpointing=off"]))
    assert any("a trainer GPU needs" in p for p in problems)
    _, problems = make_plan(load_config([*MATH_7B, "--inference.gpu_memory_utilization=0.97"]))
    assert any("an engine GPU needs" in p for p in problems)


def test_mixed_nodes_and_tensor_parallel_engines_are_placed_or_refused():
    base = ["--config", "math", "--job.stage=plan", "--model.flavour=qwen2.5-0.5b", "--plan.nodes=2"]
    cfg = load_config([*base, "--plan.gpus_per_node=4", "--world.inference_ranks=3"])
    assert [(n.trainers, n.engines, n.gpus_needed) for n in layout(cfg.plan, 3, 1)] == [(4, 0, 4), (1, 3, 4)]
    cfg = load_config([*base, "--plan.gpus_per_node=8", "--plan.procs_per_node=4", "--world.inference_ranks=3"])
    assert [n.gpus_needed for n in layout(cfg.plan, 3, 2)] == [4, 7]
    cfg = load_config([*base, "--plan.gpus_per_node=4", "--world.inference_ranks=3"])
    cfg.inference.tensor_parallel_size = 2
    _, problems = make_plan(cfg)
    assert problems and "node(s) 1 need 7 GPUs and have 4" in problems[0]
    assert "the launch scripts start the same number of processes (4) on every node" in problems[0]
    with pytest.raises(ConfigError, match="world.inference_ranks = 8 must be in"):
        layout(load_config([*base, "--plan.gpus_per_node=4"]).plan, 8, 1)


def test_async_mode_counts_its_staged_update_and_refuses_what_does_not_fit():
    # a whole update kept per engine worker (7B in bf16: 15.2 GB) beside vLLM's budget
    text, problems = make_plan(load_config(MATH_7B))
    assert problems == [] and "| weight sync: a whole staged update (rl.mode = 'async') | 0.00 |" in text
    text, problems = make_plan(load_config([*MATH_7B, "--rl.mode=async"]))
    staged = flavour_args("qwen2.5-7b").num_params() * 2 / GIB
    assert f"| weight sync: a whole staged update (rl.mode = 'async') | {staged:.2f} |" in text
    assert any("an engine GPU needs" in p and "staged update" in p for p in problems), text
    _, problems = make_plan(load_config([*MATH_7B, "--rl.mode=async", "--inference.gpu_memory_utilization=0.6"]))
    assert problems == []


def test_memory_items_follow_their_settings():
    cfg = load_config([*MATH_7B, "--trainer.defer_grad_sync=false"])
    args = flavour_args("qwen2.5-7b")
    base = trainer_memory(cfg.trainer, args, 80, checkpointing=True)
    cfg.trainer.defer_grad_sync = True
    deferred = trainer_memory(cfg.trainer, args, 80, checkpointing=True)
    assert deferred["unsharded gradients (defer_grad_sync)"] / GIB == pytest.approx(4 * 7.6156e9 / GIB, rel=1e-3)
    assert base["unsharded gradients (defer_grad_sync)"] == 0
    more_ranks = trainer_memory(cfg.trainer, args, 160, checkpointing=True)
    assert more_ranks["AdamW state (fp32 shard)"] == pytest.approx(base["AdamW state (fp32 shard)"] / 2)


def _kept_bytes_per_token(args, tokens: int) -> float:
    """Bytes autograd keeps per token for one block's activations (weights left out, shared storage once)."""
    model = build_model(args, seed=0)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and t.dtype.is_floating_point:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    pos = torch.arange(tokens)[None]
    h = torch.randn(1, tokens, args.hidden_size, requires_grad=True)
    cos, sin = rope_cos_sin(args, pos, h.dtype)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](h, cos, sin, Documents.from_positions(pos))
    return sum(kept.values()) / tokens


@pytest.mark.parametrize("shape", [{}, {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8}])
def test_activation_count_matches_what_autograd_keeps(shape):
    args = flavour_args("debug", vocab_size=64, **shape)
    measured = _kept_bytes_per_token(args, 512)
    planned = block_activation_elements(args) * 4  # fp32 on CPU
    assert planned == pytest.approx(measured, rel=0.15), (planned, measured)


def test_the_trainer_budget_and_gradient_sync_are_decided_by_the_device_and_saved(tmp_path):
    """`trainer.micro_batch_tokens` / `defer_grad_sync` "auto": today's values on CPU; on GPU the largest budget
    the plan fits in 90% of plan.gpu_memory_gib, deferred when that still fits; a value set is kept; the
    resolved values are what config.toml holds."""
    from dataclasses import replace

    from pipelinerl_fsdp.config import ModelConfig, TrainerConfig, to_toml
    from pipelinerl_fsdp.plan import AUTO_MEMORY_SHARE, GPU_MICRO_BATCH_TOKENS, resolve_trainer_defaults

    gpu = 80 * GIB
    small, big = ModelConfig(flavour="qwen2.5-0.5b"), ModelConfig(flavour="qwen2.5-7b")
    with pytest.raises(ValueError, match="still 'auto'"):
        TrainerConfig().decided()
    cpu = TrainerConfig()
    resolve_trainer_defaults(cpu, big, 1, False, gpu)
    assert cpu.decided() == (4096, False)  # CPU: as before "auto" existed, whatever the model
    tr = TrainerConfig()
    resolve_trainer_defaults(tr, small, 1, True, gpu)
    assert tr.decided() == (32768, True)  # 0.5B on one 80 GB GPU: the largest budget, one sync per step
    for n_trainers, ac in ((1, "off"), (1, "full"), (8, "off")):
        tr = TrainerConfig(activation_checkpointing=ac)
        resolve_trainer_defaults(tr, big, n_trainers, True, gpu)
        tokens, defer = tr.decided()

        def fits(t: int, d: bool, n: int = n_trainers, ckpt: bool = ac == "full", tr: TrainerConfig = tr) -> bool:
            items = trainer_memory(
                replace(tr, micro_batch_tokens=t, defer_grad_sync=d), flavour_args("qwen2.5-7b"), n, ckpt
            )
            return sum(items.values()) <= AUTO_MEMORY_SHARE * gpu

        assert fits(tokens, defer) or tokens == GPU_MICRO_BATCH_TOKENS[-1]
        larger = [t for t in GPU_MICRO_BATCH_TOKENS if t > tokens]
        assert not any(fits(t, False) for t in larger) and (defer or not fits(tokens, True))
    plain, with_ckpt = TrainerConfig(), TrainerConfig(activation_checkpointing="full")
    resolve_trainer_defaults(plain, big, 8, True, gpu)
    resolve_trainer_defaults(with_ckpt, big, 8, True, gpu)
    # 7B over 8 GPUs: checkpointing buys a larger budget
    assert plain.micro_batch_tokens < with_ckpt.micro_batch_tokens, (plain, with_ckpt)
    kept = TrainerConfig(micro_batch_tokens=1000, defer_grad_sync=False)
    resolve_trainer_defaults(kept, small, 1, True, gpu)
    assert kept.decided() == (1000, False)
    cfg = load_config(["--model.flavour=qwen2.5-0.5b"])
    assert 'micro_batch_tokens = "auto"' in to_toml(cfg)
    resolve_trainer_defaults(cfg.trainer, cfg.model, 1, True, gpu)
    text = to_toml(cfg)
    assert "micro_batch_tokens = 32768" in text and "defer_grad_sync = true" in text
    (tmp_path / "config.toml").write_text(text)
    assert load_config(["--config", str(tmp_path / "config.toml")]).trainer.decided() == (32768, True)
