"""A LoRA job's exports: every export a PEFT adapter folder with the trained factors (2 FSDP ranks) and its merged
HF folder, the one evaluation tools load. What those folders hold is checked where it is cheapest: the merged
weights against `merge_adapters` and transformers' logits, gathered from 2 FSDP ranks, in
tests/unit/training/test_export.py; `peft` and vLLM reading the adapter folder, in tests/unit/models/test_peft_io.py."""

from __future__ import annotations

import pytest
import torch
from jobs import REF, short_run

pytestmark = pytest.mark.slow


def test_a_lora_job_exports_adapters_and_their_merged_model(warm_folder, tmp_path):
    from pipelinerl_fsdp.checkpoint_layout import exported_policies
    from pipelinerl_fsdp.models.hf_io import read_state_dict
    from pipelinerl_fsdp.models.peft_io import MERGED, loadable_policy, read_adapter_folder

    r = short_run(
        3,
        1,
        warm_folder,
        tmp_path,
        REF,
        "--rl.max_steps=2",
        "--checkpoint.export_every=1",
        "--lora.enabled=true",
        "--lora.rank=4",
        "--lora.export_merged=true",
        "--trainer.optimizer.lr=1e-3",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    exports = exported_policies(tmp_path, 2)
    assert [s for s, _ in exports] == [1, 2] and exports[-1][1].name == "final"
    factors = []
    for _, folder in exports:
        cfg, adapters, base = read_adapter_folder(folder)
        assert (cfg.rank, cfg.alpha, base) == (4, 32.0, str(warm_folder))
        assert any(t.abs().max() > 0 for n, t in adapters.items() if ".lora_B." in n)  # trained off PEFT's B = 0
        factors.append(adapters)
        assert set(read_state_dict(folder / MERGED)) == set(read_state_dict(warm_folder))  # the whole model
        assert loadable_policy(folder) == folder / MERGED and (folder / MERGED / "tokenizer.json").is_file()
    assert any(not torch.equal(factors[0][k], factors[1][k]) for k in factors[0])  # the second step moved them
