"""The `[lora]` section: low-rank adapters on the decoder's linears, trained instead of the whole model."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelinerl_fsdp.config.errors import failed

# The decoder's linears an adapter may sit on, by their HF leaf names (models/decoder.py names them the same way)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ENGINE_BASES = ("auto", "device", "host")
TRAINED_STATE_KEYS = ("enabled", "rank", "alpha", "use_rslora", "target_modules")


@dataclass
class LoRAConfig:
    """Off by default. When on, the base weights are frozen (never given to the optimizer), each targeted linear
    gets W x + (alpha / rank) B A x with fp32 A [rank, in] and B [out, rank] (PEFT's layout and initialisation:
    A Kaiming-uniform, B zero, so the first policy is the base model), and only A and B are trained, checkpointed
    and pushed to the engines, which merge them into weights of their own (inference/lora_merge.py)."""

    enabled: bool = False
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    # HF leaf names of the targeted linears: all seven by default (LoRA on the MLPs too matches full fine-tuning
    # best, "LoRA Without Regret", Schulman et al. 2025)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # rank-stabilised scaling alpha / sqrt(rank) (PEFT's use_rslora) instead of alpha / rank
    use_rslora: bool = False
    # exports also get a merged HF folder (`merged/` beside the adapter files): what HF-folder tools evaluate
    export_merged: bool = False
    # where each engine keeps W0, the base copy of the targeted weights it merges from: "device" beside the weights
    # it serves; "host" in pinned host memory, moved to the GPU weight by weight at each update (frees W0's GPU
    # memory for the KV cache, for one host-to-device copy of W0 per update); "auto": the plan's choice at
    # start-up (device where the engine fits with it, else host; device on CPU, where the two are one)
    engine_base: str = "auto"

    def trained_state(self) -> dict[str, object]:
        """The keys that define what a checkpoint's adapters are (their shapes, their names, the function they
        compute): a resume must match these; dropout, exports and where the engines keep W0 may change."""
        state = {k: getattr(self, k) for k in TRAINED_STATE_KEYS}
        state["target_modules"] = sorted(self.target_modules)  # the layout follows the model, not the list's order
        return state

    @property
    def scaling(self) -> float:
        """The factor of B A in the adapted weight (PEFT's `scaling`)."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    def check(self) -> list[tuple[str, str]]:
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        return failed(
            [
                ("rank", self.rank >= 1, ">= 1"),
                ("alpha", self.alpha > 0, "> 0"),
                ("dropout", 0 <= self.dropout < 1, "in [0, 1)"),
                ("engine_base", self.engine_base in ENGINE_BASES, f"one of {list(ENGINE_BASES)}"),
                (
                    "target_modules",
                    bool(self.target_modules)
                    and not unknown
                    and len(set(self.target_modules)) == len(self.target_modules),
                    f"a non-empty list without repeats of {list(LORA_TARGETS)}"
                    + (f" (unknown: {unknown})" if unknown else ""),
                ),
            ]
        )
