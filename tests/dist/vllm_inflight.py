"""vLLM engine: an in-flight weight load between two engine steps. Checks, for every request, that tokens carry
version 0 then 1 from the update on, and that vLLM's log-probs match our decoder's "old-weight KV + new weights"
reference from the update on (and the old weights before it). Prints VLLM_INFLIGHT_OK on success.

Run: python tests/dist/vllm_inflight.py WORK_DIR
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (kv_reference)

import torch  # noqa: E402
from kv_reference import full_logprobs, logprobs_old_kv_then_new, run_to_end  # noqa: E402

from pipelinerl_fsdp.inference.engine import Request  # noqa: E402
from pipelinerl_fsdp.inference.vllm_engine import VLLMEngine  # noqa: E402
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder  # noqa: E402
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET  # noqa: E402
from pipelinerl_fsdp.tokenizer import build_char_tokenizer  # noqa: E402

T, UPDATE_AFTER, MAX_TOKENS = 0.8, 4, 12


def main() -> None:
    work = Path(sys.argv[1])
    tok = build_char_tokenizer(ALPHABET)
    args = flavour_args("debug", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    old, new = build_model(args, seed=1).eval(), build_model(args, seed=2).eval()
    save_hf_folder(work / "old", args, old.state_dict())
    tok.save_pretrained(str(work / "old"))
    engine = VLLMEngine(work / "old", max_num_seqs=8, max_len=64, temperature=T, seed=0)
    prompts = [[3, 4, 5, 13], [6, 7, 8, 9, 13], [10, 13]]
    reqs = [Request(i, p, MAX_TOKENS) for i, p in enumerate(prompts)]
    run_to_end(engine, reqs, update_after=UPDATE_AFTER, new_model=new)
    worst_before = worst_after = 0.0
    min_gap = float("inf")
    for r, p in zip(reqs, prompts):
        assert len(r.tokens) == MAX_TOKENS or r.finished, r
        m = r.versions.count(0)
        assert m == UPDATE_AFTER and r.versions == [0] * m + [1] * (len(r.tokens) - m), r.versions
        lp = torch.tensor(r.logprobs)
        worst_before = max(worst_before, (lp[:m] - full_logprobs(old, p, r.tokens, T)[:m]).abs().max().item())
        ref = logprobs_old_kv_then_new(old, new, p, r.tokens, m, T)
        worst_after = max(worst_after, (lp[m:] - ref).abs().max().item())
        min_gap = min(min_gap, (lp[m:] - full_logprobs(new, p, r.tokens, T)[m:]).abs().max().item())
    print(f"before={worst_before:.3g} after={worst_after:.3g} recompute_gap={min_gap:.3g}", flush=True)
    assert worst_before < 1e-4 and worst_after < 1e-4, "log-probs differ from the reference"
    assert min_gap > 1e-3, "the KV cache was not kept (matches a full recompute)"
    print("VLLM_INFLIGHT_OK", flush=True)


if __name__ == "__main__":
    main()
