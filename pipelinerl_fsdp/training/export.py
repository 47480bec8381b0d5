"""The trained policy written as HF folders (weights, config, the job's tokenizer): periodic exports and the final
one, loadable by transformers, vLLM and our own loader. Under LoRA an export is a PEFT adapter folder instead
(`models/peft_io.py`: what `peft` and vLLM's LoRA loader read), with the merged HF folder in `merged/` when
`lora.export_merged` is on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.checkpoint_layout import export_folder
from pipelinerl_fsdp.config import LoRAConfig
from pipelinerl_fsdp.job.world import World
from pipelinerl_fsdp.models import save_hf_folder
from pipelinerl_fsdp.models.lora import adapted_weight_name, adapter_parameters, merge_adapters
from pipelinerl_fsdp.models.peft_io import MERGED, write_adapter_folder
from pipelinerl_fsdp.training.parallelize import full_state_dict


@dataclass
class PolicyExporter:
    """Writes the trained policy under `output_dir`: `exports/step-N` (`checkpoint.export_every`), `final`
    (collective over the trainer ranks). `base_path`: the model the job started from, which an adapter export
    names as its base."""

    model: torch.nn.Module
    world: World
    tokenizer: PreTrainedTokenizerBase
    output_dir: Path
    base_path: str = ""

    def export(self, step: int | None) -> None:
        """The policy after `step` optimizer steps; None: the final one."""
        out = self.output_dir / "final" if step is None else export_folder(self.output_dir, step)
        export_policy(self.model, out, self.world, self.tokenizer, self.base_path)


def export_policy(
    model: torch.nn.Module, out: Path, world: World, tokenizer: PreTrainedTokenizerBase, base_path: str = ""
) -> None:
    """Write the trained policy as an HF folder (weights + config + the job's tokenizer); a model with adapters
    (`models.lora.apply_lora`) as a PEFT adapter folder (`export_adapters`)."""
    lora: LoRAConfig | None = getattr(model, "lora", None)
    if lora is not None:
        export_adapters(model, out, world, tokenizer, lora, base_path)
    else:
        full = full_state_dict(model, keep=world.is_main, on_cpu=True)  # collective over the trainer ranks
        if world.is_main:
            save_hf_folder(out, model.args, full, dtype=torch.float32)  # type: ignore[arg-type]
            tokenizer.save_pretrained(str(out))
    if world.is_main and out.name == "final":  # periodic exports are not worth a console line each
        print(f"[rl] exported the final policy to {out}", flush=True)
    dist.barrier(group=world.trainer_group)


@torch.no_grad()
def gathered_adapters(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """Every adapter factor as a full fp32 tensor on the host (a collective over the FSDP ranks: the adapters
    only, a few MB, never the whole model); `keep` false: gather in step, keep nothing."""
    out = {}
    for name, p in adapter_parameters(model):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if keep:
            out[name] = full.detach().to("cpu", torch.float32)
    return out


def export_adapters(
    model: torch.nn.Module,
    out: Path,
    world: World,
    tokenizer: PreTrainedTokenizerBase,
    lora: LoRAConfig,
    base_path: str,
) -> None:
    """`out` as a PEFT adapter folder (fp32 factors, `adapter_config.json` naming `base_path`, the tokenizer) and,
    with `lora.export_merged`, `out/merged/`: the HF folder of the adapted model (every adapted weight W0 + s B A,
    computed in fp32 from the trainer's W0; the whole model gathered as the plain export gathers it)."""
    adapters = gathered_adapters(model, keep=world.is_main)
    if lora.export_merged:
        full = full_state_dict(model, keep=world.is_main, on_cpu=True)
        if world.is_main:
            targets = {adapted_weight_name(n) for n in adapters}
            # W0 upcast before the merge: the frozen base may be stored in bf16, the update is kept in fp32
            merged = merge_adapters({k: v.float() if k in targets else v for k, v in full.items()}, lora)
            del full
            save_hf_folder(out / MERGED, model.args, merged, dtype=torch.float32)  # type: ignore[arg-type]
            tokenizer.save_pretrained(str(out / MERGED))
    if world.is_main:
        tokenizer.save_pretrained(str(out))
        write_adapter_folder(out, adapters, lora, base_path)  # its adapter_config.json last: the folder is whole
