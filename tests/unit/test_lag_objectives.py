"""`benchmarks/lag_objectives.py`: every named variant is a valid job config of the long-generation preset with the
loss it names, the reference implementation's keys come from its preset file, and a variant that resolves to an
earlier one is not run twice."""

from __future__ import annotations

import json

import pytest

from benchmarks import lag_objectives as lo
from pipelinerl_fsdp.configure import load_config


@pytest.mark.parametrize("name", sorted(lo.VARIANTS))
def test_every_variant_resolves_to_a_valid_long_tail_config(name):
    cfg = load_config(["--config", "long_tail", *lo.VARIANTS[name]])
    loss = cfg.loss
    expected = {
        "baseline": ("reinforce_tis", "none"),  # the preset sets no loss: the default, the paper's c = 5
        "reinforce_tis": ("reinforce_tis", "none"),
        "reference": ("cispo", "none"),
        "ppo": ("ppo", "none"),
        "token_mask": ("reinforce_tis", "token"),
        "sequence_mask": ("reinforce_tis", "sequence"),
        "lag_mask": ("reinforce_tis", "none"),
    }[name]
    assert (loss.name, loss.mask) == expected
    if name == "reinforce_tis":
        assert loss.is_clip == 5.0
    if name == "reference":  # c = 1 + 0.02, leave-one-out, not divided by the std
        assert (loss.eps_low, loss.eps_high, cfg.rl.baseline, cfg.rl.std_normalize) == (1.0, 0.02, "loo", False)
    if name == "ppo":
        assert (loss.eps_low, loss.eps_high) == (0.2, 0.2)
    if name.endswith("_mask") and name != "lag_mask":
        assert (loss.mask_low, loss.mask_high) == (0.5, 2.0)
    if name == "lag_mask":
        assert loss.max_token_lag == 4


def test_the_reference_overrides_are_its_preset_s_loss_and_rl_keys(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('[loss]\nname = "cispo"\neps_high = 0.02\n\n[rl]\nstd_normalize = false\n\n[job]\nname = "x"\n')
    assert lo.toml_overrides(preset, ("loss", "rl")) == (
        "--loss.name=cispo",
        "--loss.eps_high=0.02",
        "--rl.std_normalize=false",
    )


def test_a_variant_identical_to_an_earlier_one_repeats_it():
    assert lo.same_as("long_tail", ["baseline", "reinforce_tis", "ppo", "token_mask"]) == {"reinforce_tis": "baseline"}
    assert lo.same_as("long_tail", ["ppo", "token_mask"]) == {}


def test_a_variant_s_summary_reads_its_runs_position_metrics(tmp_path):
    mode = {
        "time_to_target_s": 50.0,
        "time_to_target_s_range": [40.0, 60.0],
        "samples_to_target": 3200.0,
        "samples_to_target_range": [2560.0, 3840.0],
        "reached_target": 2,
        "n_seeds": 3,
        "mean_ess": 0.9,
        "mean_ess_truncated": 0.95,
        "token_lag": {"p50": 1, "p90": 3, "max": 7, "hist": {}},
    }
    saved = {"settings": {"target": 0.6}, "modes": {"pipeline": mode}}
    (tmp_path / "learning_speed.json").write_text(json.dumps(saved))
    for seed, (first, last, masked) in enumerate([(0.5, 0.9, 0.1), (0.7, 1.0, 0.3)]):
        run = tmp_path / "runs" / f"pipeline_seed{seed}" / "rl"
        run.mkdir(parents=True)
        recs = [{"ess": 1.0, "ess_pos/1": first, "ess_pos/10": last, "masked_frac": masked}, {"step": 0}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = lo.variant_summary(tmp_path)
    assert s["ess_pos/1"] == pytest.approx(0.6) and s["ess_pos/10"] == pytest.approx(0.95)
    assert s["masked_frac"] == pytest.approx(0.2) and s["abs_log_ratio_pos/1"] is None
    assert s["reached"] == "2/3" and s["token_lag"] == {"p50": 1, "p90": 3, "max": 7}
    row = lo.row("ppo", s, None)
    assert row[0] == "ppo" and row[1] == "50.0 (40.0-60.0)" and row[6] == "0.6000 / 0.9500"
    assert lo.row("reinforce_tis", s, "baseline")[0] == "reinforce_tis (= baseline)"
