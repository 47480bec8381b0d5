"""Model hyper-parameters, their HF `config.json` form, and the named debug flavours."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# The decoder families we implement, keyed by HF `model_type`, with the HF architecture class name.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelArgs:
    """Hyper-parameters of one decoder (Llama / Qwen2 / Qwen3 family)."""

    model_type: str = "qwen2"
    vocab_size: int = 32
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # q/k/v projections carry a bias (Qwen2); Llama's `attention_bias` also biases o_proj.
    qkv_bias: bool = True
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; choose one of {sorted(ARCHITECTURES)}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported; choose one of {ROPE_TYPES}")

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        hd = self.head_dim
        assert hd is not None
        q = self.hidden_size * self.num_attention_heads * hd
        kv = 2 * self.hidden_size * self.num_key_value_heads * hd
        o = self.num_attention_heads * hd * self.hidden_size
        bias = (self.num_attention_heads + 2 * self.num_key_value_heads) * hd if self.qkv_bias else 0
        bias += self.hidden_size if self.o_bias else 0
        norms = 2 * self.hidden_size + (2 * hd if self.qk_norm else 0)
        mlp = 3 * self.hidden_size * self.intermediate_size
        layer = q + kv + o + bias + norms + mlp
        emb = self.vocab_size * self.hidden_size
        return self.num_hidden_layers * layer + emb * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    # ---- HF config.json ---------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Build from an HF `config.json` dict (transformers v4 `rope_theta/rope_scaling` or v5 `rope_parameters`)."""
        model_type = cfg.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; choose one of {sorted(ARCHITECTURES)}"
            )
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config.json hidden_act {hidden_act!r} is not supported (only 'silu')")
        rope = dict(cfg.get("rope_parameters") or {})
        if not rope:
            rope = dict(cfg.get("rope_scaling") or {})
            if "type" in rope and "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type")
            rope.setdefault("rope_type", "default")
            rope["rope_theta"] = cfg.get("rope_theta", 10000.0)
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim"),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=model_type == "qwen3",
            rope_parameters=rope,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
        )

    def to_hf_config(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """The HF `config.json` dict that transformers and vLLM read for this model."""
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias):
            raise ValueError("qwen2 checkpoints always have q/k/v bias and no o_proj bias")
        if self.model_type != "qwen2" and self.qkv_bias != self.o_bias:
            raise ValueError(f"{self.model_type} has one `attention_bias` switch for q/k/v/o together")
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": dict(self.rope_parameters),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": torch_dtype,
            "use_cache": True,
        }
        if self.model_type != "qwen2":
            cfg["attention_bias"] = self.qkv_bias
        return cfg


# Named flavours for building a model from scratch (random init). "debug" is the ~0.8M-parameter CPU model.
FLAVOURS: dict[str, ModelArgs] = {
    "debug": ModelArgs(
        model_type="qwen2",
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "debug-llama": ModelArgs(
        model_type="llama",
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        qkv_bias=False,
    ),
    "debug-qwen3": ModelArgs(
        model_type="qwen3",
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        qkv_bias=False,
        qk_norm=True,
    ),
    # ~100M parameters (with a 32k vocabulary): for CPU benchmarks of engines and weight sync.
    "small": ModelArgs(
        model_type="qwen2",
        vocab_size=32768,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    ),
    # Public Qwen2.5 shapes (random weights when built): for `--job.stage=plan` and the GPU check
    "qwen2.5-0.5b": ModelArgs(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=32768,
    ),
    "qwen2.5-1.5b": ModelArgs(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=32768,
    ),
    "qwen2.5-7b": ModelArgs(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=32768,
    ),
}


def flavour_args(name: str, **overrides: Any) -> ModelArgs:
    """A copy of the named flavour with some fields replaced (e.g. the tokenizer's vocab size)."""
    if name not in FLAVOURS:
        raise ValueError(f"unknown model flavour {name!r}; choose one of {sorted(FLAVOURS)}")
    return dataclasses.replace(FLAVOURS[name], **overrides)
