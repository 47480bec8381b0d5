"""Our decoder against transformers on random tiny configs of each family (fp32)."""

from __future__ import annotations

import json

import pytest
import torch

from pipelinerl_fsdp.models import ModelArgs, build_model, load_hf_model, save_hf_folder

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "qwen2": dict(model_type="qwen2", qkv_bias=True),
    "llama": dict(model_type="llama", qkv_bias=False),
    "llama-bias-llama3rope": dict(
        model_type="llama",
        qkv_bias=True,
        o_bias=True,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "llama-linear-rope": dict(
        model_type="llama", qkv_bias=False, rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}
    ),
    "qwen3": dict(model_type="qwen3", qkv_bias=False, qk_norm=True, head_dim=24),
    "qwen2-tied": dict(model_type="qwen2", qkv_bias=True, tie_word_embeddings=True),
}


def tiny_args(**kw) -> ModelArgs:
    base = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
    )
    base.update(kw)
    return ModelArgs(**base)


def hf_model_from_folder(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(params=list(FAMILIES))
def saved_pair(request, tmp_path):
    torch.manual_seed(0)
    args = tiny_args(**FAMILIES[request.param])
    ours = build_model(args, seed=1)
    with torch.no_grad():  # non-trivial norms and biases so they are really compared
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    save_hf_folder(tmp_path, args, ours.state_dict())
    return ours.eval(), hf_model_from_folder(tmp_path), tmp_path


def test_logits_match_transformers(saved_pair):
    ours, hf, _ = saved_pair
    ids = torch.randint(0, 97, (3, 21))
    with torch.no_grad():
        a = ours(ids)
        b = hf(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_hf_checkpoint_loads_in_ours(saved_pair, tmp_path):
    ours, hf, _ = saved_pair
    hf_dir = tmp_path / "from_hf"
    hf.save_pretrained(hf_dir)  # written by transformers itself
    reloaded = load_hf_model(hf_dir).eval()
    ids = torch.randint(0, 97, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_packed_logprobs_equal_per_sequence(saved_pair):
    ours, _, _ = saved_pair
    lengths = [5, 9, 3, 7]
    seqs = [torch.randint(0, 97, (n + 1,)) for n in lengths]
    packed_in = torch.cat([s[:-1] for s in seqs])[None]
    packed_tgt = torch.cat([s[1:] for s in seqs])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        lp, ent = ours(packed_in, pos, targets=packed_tgt, temperature=0.7)
        singles = [ours(s[None, :-1], targets=s[None, 1:], temperature=0.7)[0][0] for s in seqs]
        ref = torch.log_softmax(ours(seqs[0][None, :-1]) / 0.7, dim=-1)
    torch.testing.assert_close(lp[0], torch.cat(singles), rtol=1e-5, atol=1e-5)
    # entropy of the first sequence against a direct computation
    direct_ent = -(ref.exp() * ref).sum(-1)[0]
    torch.testing.assert_close(ent[0, : lengths[0]], direct_ent, rtol=1e-5, atol=1e-5)


def test_sharded_save_roundtrip(tmp_path):
    args = tiny_args(model_type="qwen2")
    ours = build_model(args, seed=3).eval()
    save_hf_folder(tmp_path, args, ours.state_dict(), max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = load_hf_model(tmp_path)
    for (k, a), (_, b) in zip(ours.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), k
    hf = hf_model_from_folder(tmp_path)
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_mismatched_checkpoint_is_an_error(tmp_path):
    args = tiny_args()
    sd = build_model(args).state_dict()
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_hf_folder(tmp_path, args, sd)
    with pytest.raises(ValueError, match="missing .*up_proj"):
        load_hf_model(tmp_path)
