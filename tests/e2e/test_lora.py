"""A LoRA job end to end on vLLM (1 engine + 1 trainer): only the adapters travel, the engine's merged weights score
the tokens it samples as the trainer's adapted model does, the checkpoint holds only the adapters, and the final
export is a PEFT adapter folder (its format and merged folder: test_lora_exports.py)."""

from __future__ import annotations

import json

import pytest
import torch
from jobs import VLLM, records, short_run

from pipelinerl_fsdp.checkpoint_layout import latest_checkpoint
from pipelinerl_fsdp.models import load_hf_model
from pipelinerl_fsdp.models.hf_io import read_model_args
from pipelinerl_fsdp.models.peft_io import merge_into_base, read_adapter_folder

pytestmark = pytest.mark.slow
RANK = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter_bytes(folder) -> int:
    """fp32 bytes of rank-RANK adapters on every linear, by hand: rank x (in + out) per linear per layer."""
    a = read_model_args(folder)
    hd = a.head_dim or a.hidden_size // a.num_attention_heads
    h, q, kv, i = a.hidden_size, a.num_attention_heads * hd, a.num_key_value_heads * hd, a.intermediate_size
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return 4 * RANK * per_layer * a.num_hidden_layers


@pytest.mark.parametrize("engine", [VLLM])
def test_a_lora_job_pushes_adapters_that_the_engine_merges_exactly(warm_folder, tmp_path, engine):
    r = short_run(
        2,
        1,
        warm_folder,
        tmp_path,
        f"--inference.engine={engine}",
        # every token sampled by the version being trained (lag 0), so every step compares the two sides
        "--rl.mode=conventional",
        "--lora.enabled=true",
        f"--lora.rank={RANK}",
        "--trainer.optimizer.lr=1e-3",  # adapters that move in 12 steps, so a wrong merge would show
        "--trainer.optimizer.warmup_steps=0",
        "--rl.kl_coef=0.001",  # the KL reference: the policy with its adapters off
        "--checkpoint.interval=6",
        "--metrics.log_every=1",
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    recs = records(tmp_path)
    assert len(recs) == 12
    # every update carries the adapters, nothing else
    pushed = [x["push_mb"] for x in recs if x["push_mb"] == x["push_mb"]]  # NaN: no push ended in that step
    assert len(pushed) >= 10 and {round(mb * 1e6) for mb in pushed} == {adapter_bytes(warm_folder)}
    # tokens sampled by the engine's merged weights of version v, scored by the trainer's adapted model of version
    # v: the same up to float rounding (full fine-tuning reads ~5e-6 here); a merge with a wrong scaling, a stale
    # base or a missed module reads orders of magnitude more once the adapters have moved
    lag0 = [x["mismatch_abs_log_ratio"] for x in recs[3:] if x["mismatch_abs_log_ratio"] == x["mismatch_abs_log_ratio"]]
    assert lag0 and max(lag0) < 1e-3, lag0
    # the run's config.toml holds the decided "auto" keys: engines on CPU keep W0 beside their weights
    assert 'engine_base = "device"' in (tmp_path / "config.toml").read_text()
    # KL to the base on the sampled tokens (k3): exactly 0 while B = 0 (the first step's policy is the base); from
    # step 6 on far above what the lag-0 bound above allows engine against trainer (measured 0.22-2.3; a reference
    # that kept its adapters on would read 0 throughout)
    kl = [x["kl"] for x in recs]
    assert kl[0] == 0.0 and min(kl[5:]) > 1e-2, kl
    ck = latest_checkpoint(tmp_path / "checkpoints")
    assert ck is not None and json.loads((ck / "meta.json").read_text())["lora"]["rank"] == RANK
    final = tmp_path / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK and sorted(config["target_modules"]) == sorted(TARGETS)
    lora, adapters, _ = read_adapter_folder(final)
    assert max(float(t.abs().max()) for k, t in adapters.items() if ".lora_B." in k) > 0  # they learned
    # and moved the policy far beyond the bound above: a merge that missed them would have been caught
    ids = torch.randint(0, read_model_args(warm_folder).vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    base = load_hf_model(warm_folder).eval()
    merged = load_hf_model(warm_folder)
    merged.load_state_dict(merge_into_base(warm_folder, adapters, lora), strict=False)
    with torch.no_grad():
        moved = (base(ids).log_softmax(-1) - merged.eval()(ids).log_softmax(-1)).abs().mean()
    assert moved > 1e-2, float(moved)
