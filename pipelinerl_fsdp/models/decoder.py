"""One pure-PyTorch decoder for the Llama, Qwen2/Qwen2.5 and Qwen3 families, with HF-compatible parameter names.

Inputs may be *packed*: several sequences in one row, `position_ids` restarting at 0 at each sequence start;
attention is causal and confined to each sequence. A `KVCache` (see `pipelinerl_fsdp.inference.kv_cache`) turns
the same forward into prefill / decode steps for generation.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipelinerl_fsdp.models.args import ModelArgs

# `document_attention` re-exported: the per-document loop, callers (benchmarks) import it from here
from pipelinerl_fsdp.models.documents import Documents, attend_documents
from pipelinerl_fsdp.models.documents import document_attention as document_attention
from pipelinerl_fsdp.models.logprobs import token_logprobs


class AttentionCache(Protocol):
    """What attention needs from a KV cache (implemented by `inference.kv_cache.KVCache`)."""

    decoding: bool

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def attend_keys(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_inv_freq(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies of RoPE for the checkpoint's theta and scaling (default, linear, llama3)."""
    dim = args.head_dim
    assert dim is not None
    rope = args.rope_parameters
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(rope["factor"])
    elif kind == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(args: ModelArgs, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, T, head_dim] for the given positions, computed in fp32."""
    inv_freq = rope_inv_freq(args, position_ids.device)
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, hd]; cos/sin: [B, T, hd]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, T, T] mask: token i sees token j iff j <= i and both belong to the same packed sequence.

    A sequence starts wherever `position_ids` is 0.
    """
    seg = torch.cumsum((position_ids == 0).to(torch.int32), dim=-1)
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    same = seg[:, :, None] == seg[:, None, :]
    return (same & causal)[:, None]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        hd = args.head_dim
        assert hd is not None
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * hd, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv * hd, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv * hd, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.rms_norm_eps)
            self.k_norm = RMSNorm(hd, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | Documents | None,
        cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None and cache.decoding:
            k, v, mask = cache.attend_keys(self.layer_idx, k, v)
        elif cache is not None:
            cache.store(self.layer_idx, k, v)
        gqa = self.n_kv != self.n_heads
        if isinstance(mask, Documents):
            out = attend_documents(q, k, v, mask, gqa)  # one varlen kernel on a GPU, a loop on CPU
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # activation checkpointing (set by `parallelize.apply_activation_checkpointing`): a flag rather than a
        # wrapper module, so parameter names (checkpoints, weight sync) stay the HF ones
        self.checkpointed = False

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | Documents | None,
        cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        if self.checkpointed and cache is None and torch.is_grad_enabled():
            return checkpoint(self._block, x, cos, sin, mask, None, use_reentrant=False)
        return self._block(x, cos, sin, mask, cache)

    def _block(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | Documents | None,
        cache: AttentionCache | None,
    ) -> torch.Tensor:
        # the parts around attention are methods of their own: `parallelize.apply_compile` compiles them, not
        # attention, whose per-document loop a compiled graph would specialise on (a recompile per packing)
        return self.post_attention(x, self.self_attn(self.pre_attention(x), cos, sin, mask, cache))

    def pre_attention(self, x: torch.Tensor) -> torch.Tensor:
        """What runs on the block's input before attention: its norm."""
        return self.input_layernorm(x)

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """What runs after attention: the residual, the norm, the MLP and its residual."""
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """The HF `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(args, i) for i in range(args.num_hidden_layers)])
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    """Causal LM. `forward` returns logits, or per-token log-probs of `targets` (memory-efficient) when given."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderBody(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # log-probs from logits rounded to the head's dtype (`trainer.fp32_head = "off"`, set by `apply_fsdp`);
        # otherwise they are fp32 whatever that dtype
        self.round_logits = False

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Random init (after construction on the meta device and `to_empty`)."""
        gen = torch.Generator(device="cpu")
        if seed is not None:
            gen.manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        cache: AttentionCache | None = None,
        mask: torch.Tensor | None = None,
        logprob_chunk_size: int = 1024,
        logprob_positions: torch.Tensor | None = None,
        documents: Documents | None = None,
        logprob_index: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, position_ids, targets: [B, T]. Without targets: logits [B, T, V] (fp32).

        With targets: (logp [B, T], entropy [B, T]) of `targets` under softmax(logits / temperature).
        `logprob_positions` ([B, T], nonzero where a log-prob is needed): the head runs only there, and logp and
        entropy are 0 elsewhere. An RL step needs them at completion tokens only, and the head over a large
        vocabulary is a large share of a small model's work (SmolLM2: 28M of its 135M parameters), most of it
        spent on prompt positions otherwise.
        `mask` overrides the packed-causal mask derived from position_ids (the KV cache supplies its own).
        `documents`: the packed sequences as the packer built them on the host (`rl.packing.pack_row`); without them
        they are derived from position_ids, which reads the device back to the host (a sync on a GPU).
        `logprob_index`: the flat indices into [B * T] of `logprob_positions`' nonzero entries, built on the host by
        the packer (`rl.packing.nonzero_index`); without it they are read from the mask (a sync on a GPU).
        """
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.args, position_ids, h.dtype)
        attend: torch.Tensor | Documents | None = mask
        if mask is None and (cache is None or not cache.decoding):
            # training, scoring and the engine's packed prefill: attention per sequence, no [T, T] tensor (a prefill
            # of 120 sequences in flight, recomputed at an update, packs ~10k tokens: a dense mask made it quadratic)
            attend = documents if documents is not None else Documents.from_positions(position_ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, attend, cache)
        h = self.model.norm(h)
        if targets is None:
            return self.lm_head(h).float()
        w, rounded = self.lm_head.weight, self.round_logits
        if logprob_positions is None and logprob_index is None:
            return token_logprobs(h, w, targets, temperature, logprob_chunk_size, rounded)
        # integer indices, not a boolean mask: selecting by a mask counts its entries on the host (a sync on a GPU)
        if logprob_index is None:
            logprob_index = logprob_positions.flatten().nonzero().squeeze(1)
        h, targets_sel = h.flatten(0, 1)[logprob_index], targets.flatten()[logprob_index]
        logp, entropy = token_logprobs(h, w, targets_sel, temperature, logprob_chunk_size, rounded)
        where = (logprob_index // t, logprob_index % t)
        zeros = torch.zeros(targets.shape, dtype=torch.float32, device=h.device)
        return zeros.index_put(where, logp), zeros.index_put(where, entropy)


def build_model(
    args: ModelArgs, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int | None = 0
) -> Transformer:
    """Construct on the meta device, materialise on `device`, random-initialise."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    if model.args.tie_word_embeddings:  # to_empty breaks the tie
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_weights(seed=seed)
    return model.to(dtype)
