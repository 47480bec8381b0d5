"""A LoRA job's exports: every export a PEFT adapter folder with the trained factors (2 FSDP ranks), its merged HF
folder equal to the base merged with them, and `peft` reading the adapters onto the base with the merged model's
logits."""

from __future__ import annotations

import pytest
import torch
from jobs import REF, short_run

pytestmark = pytest.mark.slow


def test_a_lora_job_exports_adapters_and_their_merged_model(warm_folder, tmp_path):
    from pipelinerl_fsdp.checkpoint_layout import exported_policies
    from pipelinerl_fsdp.models import load_hf_model
    from pipelinerl_fsdp.models.hf_io import read_state_dict
    from pipelinerl_fsdp.models.peft_io import MERGED, loadable_policy, merge_into_base, read_adapter_folder

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
        merged = read_state_dict(folder / MERGED)
        expect = merge_into_base(warm_folder, adapters, cfg)
        assert set(merged) == set(expect) and all(torch.equal(merged[k], expect[k]) for k in merged)
        assert loadable_policy(folder) == folder / MERGED and (folder / MERGED / "tokenizer.json").is_file()
    assert any(not torch.equal(factors[0][k], factors[1][k]) for k in factors[0])  # the second step moved them
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    final = exports[-1][1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(warm_folder, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(hf, str(final)).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, load_hf_model(final / MERGED).eval()(ids), atol=2e-5, rtol=1e-5)
