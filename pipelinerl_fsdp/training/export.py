"""The trained policy written as HF folders (weights, config, the job's tokenizer): periodic exports and the final
one, loadable by transformers, vLLM and our own loader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.checkpoint_layout import export_folder
from pipelinerl_fsdp.job.world import World
from pipelinerl_fsdp.models import save_hf_folder
from pipelinerl_fsdp.training.parallelize import full_state_dict


@dataclass
class PolicyExporter:
    """Writes the trained policy as HF folders under `output_dir`: `exports/step-N` (`checkpoint.export_every`),
    `final` (collective over the trainer ranks)."""

    model: torch.nn.Module
    world: World
    tokenizer: PreTrainedTokenizerBase
    output_dir: Path

    def export(self, step: int | None) -> None:
        """The policy after `step` optimizer steps; None: the final one."""
        out = self.output_dir / "final" if step is None else export_folder(self.output_dir, step)
        export_policy(self.model, out, self.world, self.tokenizer)


def export_policy(model: torch.nn.Module, out: Path, world: World, tokenizer: PreTrainedTokenizerBase) -> None:
    """Write the trained policy as an HF folder (weights + config + the job's tokenizer)."""
    full = full_state_dict(model, keep=world.is_main, on_cpu=True)  # collective over the trainer ranks
    if world.is_main:
        args = model.args  # type: ignore[attr-defined]
        save_hf_folder(out, args, full, dtype=torch.float32)
        tokenizer.save_pretrained(str(out))
        if out.name == "final":  # periodic exports are not worth a console line each
            print(f"[rl] exported the final policy to {out}", flush=True)
    dist.barrier(group=world.trainer_group)
