"""PEFT's adapter folder (what `peft.PeftModel.from_pretrained` and vLLM's LoRA loader read): `adapter_config.json`
and `adapter_model.safetensors`, whose keys are `base_model.model.` + our adapter names (`models/lora.py` names
them as PEFT does, less that prefix), fp32. And the HF folder an exported policy is evaluated from: the export
itself (full fine-tuning), or, under LoRA, its `merged/` subfolder (W0 + s B A for every adapted weight), written
by the trainer (`lora.export_merged`) or here on first use from the base the adapter names."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pipelinerl_fsdp.config.lora import LoRAConfig
from pipelinerl_fsdp.models.hf_io import read_json, read_model_args, read_state_dict, save_hf_folder
from pipelinerl_fsdp.models.lora import adapted_weight_name, merge_adapters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
MERGED = "merged"  # the subfolder of an adapter export that holds the merged HF folder


def adapter_config(cfg: LoRAConfig, base_path: str) -> dict[str, Any]:
    """The `adapter_config.json` of adapters trained under `cfg` on the model at `base_path`: PEFT's LoRA fields
    (a plain LoRA: no bias, no DoRA, no saved full modules, nothing vLLM's loader refuses)."""
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha  # vLLM's PEFTHelper types it int
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": cfg.rank,
        "lora_alpha": alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": list(cfg.target_modules),
        "use_rslora": cfg.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_adapter_folder(
    folder: str | Path, adapters: dict[str, torch.Tensor], cfg: LoRAConfig, base_path: str
) -> None:
    """Write `adapters` (full tensors under our names: `model.layers.N....lora_A.weight`) as a PEFT adapter folder,
    fp32. `adapter_config.json` goes last: a folder that has it is complete (`checkpoint_layout.exported_policies`
    lists a final export by it)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + k: v.detach().to("cpu", torch.float32).contiguous() for k, v in adapters.items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, base_path), indent=2) + "\n")


def read_adapter_folder(folder: str | Path) -> tuple[LoRAConfig, dict[str, torch.Tensor], str]:
    """(the adapters' `[lora]` settings, their tensors under our names, the base model's path) of a PEFT adapter
    folder written by `write_adapter_folder` (or by PEFT, for a plain LoRA on our decoder's linears)."""
    folder = Path(folder)
    meta = read_json(folder / ADAPTER_CONFIG)
    if meta.get("peft_type") != "LORA" or meta.get("use_dora") or meta.get("bias", "none") != "none":
        raise ValueError(f"{folder / ADAPTER_CONFIG}: not a plain LoRA adapter (peft_type LORA, no DoRA, no bias)")
    targets = meta["target_modules"]
    # what PEFT can express and one scaling per model cannot: per-module ranks or alphas, a subset of layers, a
    # regular expression over module names (a string `target_modules`)
    special = [k for k in ("rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern") if meta.get(k)]
    if special or isinstance(targets, str):
        what = special + (["target_modules as a regular expression"] if isinstance(targets, str) else [])
        raise ValueError(f"{folder / ADAPTER_CONFIG}: {', '.join(what)}: only one rank and alpha for a list of modules")
    cfg = LoRAConfig(
        enabled=True,
        rank=int(meta["r"]),
        alpha=float(meta["lora_alpha"]),
        dropout=float(meta.get("lora_dropout", 0.0)),
        target_modules=list(targets),
        use_rslora=bool(meta.get("use_rslora", False)),
    )
    problems = cfg.check()
    if problems:
        raise ValueError(f"{folder / ADAPTER_CONFIG}: " + "; ".join(f"{k} must be {why}" for k, why in problems))
    raw = load_file(str(folder / ADAPTER_WEIGHTS))
    foreign = [k for k in raw if not k.startswith(PEFT_PREFIX)]
    if foreign:
        raise ValueError(f"{folder / ADAPTER_WEIGHTS}: keys without the {PEFT_PREFIX!r} prefix: {foreign[:4]}")
    return cfg, {k.removeprefix(PEFT_PREFIX): v for k, v in raw.items()}, meta.get("base_model_name_or_path") or ""


def merge_into_base(base_folder: str | Path, adapters: dict[str, torch.Tensor], cfg: LoRAConfig) -> dict:
    """The merged state dict of the model at `base_folder` with `adapters`: every adapted weight W0 + s B A in fp32
    (`models.lora.merged_weight` on W0 upcast, as the trainer's merged export computes it); the rest as stored."""
    state = read_state_dict(base_folder)
    targets = {adapted_weight_name(n) for n in adapters}
    missing = sorted(targets - set(state))
    if missing:
        raise ValueError(f"{base_folder}: no weights {missing[:4]} for the adapters")
    state = {k: v.float() if k in targets else v for k, v in state.items()}
    return merge_adapters({**state, **adapters}, cfg)


def loadable_policy(export: str | Path) -> Path:
    """The HF folder (config.json + weights) an exported policy is evaluated from: the export itself when it is
    one (full fine-tuning), else its `merged/` subfolder, which is written now, once, from the adapters and the
    base model their `adapter_config.json` names when the trainer did not write it (`lora.export_merged` off).
    The tokenizer files of the export are copied beside the merged weights."""
    export = Path(export)
    merged = export / MERGED
    if (export / "config.json").is_file():
        return export
    if (merged / "config.json").is_file():
        return merged
    if not (export / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{export}: neither an HF folder (config.json) nor a PEFT adapter folder")
    cfg, adapters, base = read_adapter_folder(export)
    if not base or not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(
            f"{export / ADAPTER_CONFIG}: base_model_name_or_path {base!r} is not an HF folder here; merge from "
            "the job's directory, or set lora.export_merged = true for the run"
        )
    # written beside and renamed into place: an interrupted merge leaves no half folder that looks complete
    tmp = Path(tempfile.mkdtemp(prefix=".merging-", dir=export))
    try:
        save_hf_folder(tmp, read_model_args(base), merge_into_base(base, adapters, cfg), dtype=torch.float32)
        for f in export.iterdir():
            if f.is_file() and f.name not in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                shutil.copy2(f, tmp / f.name)
        os.replace(tmp, merged)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return merged
