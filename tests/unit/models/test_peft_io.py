"""PEFT's adapter folder as we write it: read back by `peft` (the same logits as our adapted model), by vLLM's own
LoRA loader (the same tensors, its checks passed), by our reader; and the merged HF folder an adapter export is
evaluated from, written on first use from the base the adapter names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipelinerl_fsdp.config import LoRAConfig
from pipelinerl_fsdp.models import build_model, flavour_args, load_hf_model, save_hf_folder
from pipelinerl_fsdp.models.lora import adapter_parameters, apply_lora, merge_adapters
from pipelinerl_fsdp.models.peft_io import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MERGED,
    loadable_policy,
    read_adapter_folder,
    write_adapter_folder,
)

ARGS = flavour_args("debug-llama", vocab_size=96, num_hidden_layers=2)
# three of the seven targets: an adapter that leaves some linears alone is read as one too
CFG = LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def adapted_model(base: Path, cfg: LoRAConfig = CFG) -> torch.nn.Module:
    """A tiny Llama built by our code, its base saved as an HF folder in `base`, then adapted with random non-zero
    factors (B = 0, PEFT's start, would make every comparison below trivially true)."""
    model = build_model(ARGS, seed=0)
    save_hf_folder(base, ARGS, model.state_dict())
    apply_lora(model, cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def adapters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in adapter_parameters(model)}


@pytest.fixture
def exported(tmp_path: Path) -> tuple[torch.nn.Module, Path, Path]:
    """(our adapted model, its base's HF folder, its adapter folder)."""
    base, folder = tmp_path / "base", tmp_path / "adapter"
    model = adapted_model(base)
    write_adapter_folder(folder, adapters_of(model), CFG, str(base))
    return model, base, folder


def test_the_folder_holds_pefts_keys_and_config(exported):
    model, base, folder = exported
    meta = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert (meta["peft_type"], meta["task_type"], meta["base_model_name_or_path"]) == ("LORA", "CAUSAL_LM", str(base))
    assert (meta["r"], meta["lora_alpha"], meta["target_modules"]) == (4, 8, ["q_proj", "v_proj", "down_proj"])
    assert meta["bias"] == "none" and meta["use_dora"] is False and meta["modules_to_save"] is None
    from safetensors import safe_open

    with safe_open(str(folder / ADAPTER_WEIGHTS), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor(next(iter(keys))).dtype == torch.float32
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    assert keys == {"base_model.model." + n for n, _ in adapter_parameters(model)}
    cfg, tensors, base_path = read_adapter_folder(folder)
    assert (cfg.rank, cfg.alpha, cfg.target_modules, cfg.scaling) == (4, 8.0, CFG.target_modules, 2.0)
    assert base_path == str(base)
    for name, p in adapter_parameters(model):
        assert torch.equal(tensors[name], p), name


def test_peft_loads_it_onto_the_transformers_base_with_our_logits(exported):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model, base, folder = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(hf, str(folder)).eval()
    assert adapted.peft_config["default"].r == 4
    ids = torch.randint(0, ARGS.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(ids), adapted(ids).logits
        with adapted.disable_adapter():
            plain = adapted(ids).logits
    # fp32, both compute x W^T + s B(A x), in different kernels: the decoders agree to 1e-5 without adapters
    # (test_model_parity.py)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    assert (theirs - plain).abs().max() > 1e-2  # the adapters were applied, not dropped


def test_vllms_peft_loader_accepts_it_with_our_tensors(exported):
    pytest.importorskip("vllm")
    from vllm.config.lora import LoRAConfig as VLLMLoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    model, _, folder = exported
    helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings=ARGS.max_position_embeddings)
    helper.validate_legal(VLLMLoRAConfig(max_lora_rank=8))  # raises on anything vLLM does not run
    assert helper.vllm_lora_scaling_factor == CFG.scaling
    with pytest.raises(ValueError, match="greater than max_lora_rank"):
        helper.validate_legal(VLLMLoRAConfig(max_lora_rank=1))
    # vLLM's Llama: q/k/v and gate/up are packed, their HF names are the expected modules
    expected = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    loaded = LoRAModel.from_local_checkpoint(
        str(folder), expected, helper, lora_model_id=1, device="cpu", dtype=torch.float32
    )
    assert loaded.rank == 4
    ours = dict(adapter_parameters(model))
    assert len(loaded.loras) == len(ours) // 2
    for name, lora in loaded.loras.items():
        assert torch.equal(lora.lora_a, ours[f"{name}.lora_A.weight"]), name
        assert torch.equal(lora.lora_b, ours[f"{name}.lora_B.weight"]), name
    with pytest.raises(ValueError, match="expected target modules"):
        LoRAModel.from_local_checkpoint(str(folder), {"q_proj"}, helper, lora_model_id=2, device="cpu")


def test_an_adapter_export_is_evaluated_from_its_merged_folder_written_once(exported):
    model, base, folder = exported
    (folder / "tokenizer_config.json").write_text("{}")  # stands for the tokenizer files the export holds
    merged = loadable_policy(folder)
    assert merged == folder / MERGED and (merged / "tokenizer_config.json").is_file()
    assert not [p for p in folder.iterdir() if p.name.startswith(".merging-")]
    reloaded = load_hf_model(merged).eval()
    expect = merge_adapters(model.state_dict(), CFG)
    got = reloaded.state_dict()
    assert set(got) == set(expect)
    for k in expect:
        assert torch.equal(got[k], expect[k]), k  # fp32 base: the same merge, bit for bit
    ids = torch.randint(0, ARGS.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids), model(ids), atol=2e-5, rtol=1e-5)
    stamp = (merged / "model.safetensors").stat().st_mtime_ns
    assert loadable_policy(folder) == merged and (merged / "model.safetensors").stat().st_mtime_ns == stamp
    assert loadable_policy(base) == base  # a plain HF folder is its own


def test_a_folder_that_is_neither_or_has_no_base_here_is_named(tmp_path, exported):
    _, _, folder = exported
    with pytest.raises(FileNotFoundError, match="neither an HF folder"):
        loadable_policy(tmp_path / "nothing")
    meta = json.loads((folder / ADAPTER_CONFIG).read_text())
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**meta, "base_model_name_or_path": str(tmp_path / "gone")}))
    with pytest.raises(FileNotFoundError, match="export_merged"):
        loadable_policy(folder)
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**meta, "use_dora": True}))
    with pytest.raises(ValueError, match="not a plain LoRA"):
        read_adapter_folder(folder)
    # what one rank, one alpha and a list of our linears cannot express is refused, named, not merged wrongly
    for extra, named in (
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"alpha_pattern": {"v_proj": 4.0}}, "alpha_pattern"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"target_modules": ".*q_proj"}, "target_modules as a regular expression"),
        ({"target_modules": ["q_proj", "qkv_proj"]}, r"target_modules must be .*unknown: \['qkv_proj'\]"),
    ):
        (folder / ADAPTER_CONFIG).write_text(json.dumps({**meta, **extra}))
        with pytest.raises(ValueError, match=named):
            read_adapter_folder(folder)
    # PEFT's empty defaults are the plain case
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**meta, "rank_pattern": {}, "layers_to_transform": None}))
    assert read_adapter_folder(folder)[0].rank == CFG.rank
