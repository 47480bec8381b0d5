"""vLLM inside a torchrun job (engine core in its own process), exactly as the inference ranks run it: rank 0 plays
the first trainer rank (WeightSender, buckets over the store-built group), rank 1 runs `VLLMEngine` and takes
each update while requests are being
generated (once one of them has LANDING tokens).

Phase 1 (keep KV): engine starts with `old`, the update carries `new` (version 1). Phase 2 (recompute): requests
start under `new`, the update carries `old` again (version 2) with `recompute=True`. For every request the
versions the engine reports must split the tokens exactly where the weights changed: log-probs before the split
match the old weights; after it they match "old-weight KV + new weights" (phase 1) or a full recompute under the
new weights (phase 2). A split off by one token would mismatch, and so would weights loaded wrong (a fused q/k/v
slice in the wrong place, a CPU linear still computing with its old packed copy). Prints VLLM_JOB_OK on success.

Run: torchrun --nproc-per-node 2 tests/dist/vllm_job_update.py WORK_DIR [LOAD]   (LOAD: inference.vllm_weight_load)
"""

import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (kv_reference)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kv_reference import full_logprobs, logprobs_old_kv_then_new  # noqa: E402
from pipelinerl_fsdp.config import Config  # noqa: E402
from pipelinerl_fsdp.inference.engine import Request  # noqa: E402
from pipelinerl_fsdp.inference.placement import vllm_placement  # noqa: E402
from pipelinerl_fsdp.inference.vllm_engine import VLLMEngine  # noqa: E402
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder  # noqa: E402
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET  # noqa: E402
from pipelinerl_fsdp.tokenizer import build_char_tokenizer  # noqa: E402
from pipelinerl_fsdp.transport.store_group import join_store_group, store_address  # noqa: E402
from pipelinerl_fsdp.transport.weights import STOP, UPDATE, WeightReceiver, WeightSender  # noqa: E402
from pipelinerl_fsdp.job.world import init_world  # noqa: E402

# The update is taken once a request has generated LANDING tokens (vLLM streams each step's output), so it lands
# mid-sequence whatever the machine's speed. Timing it instead (send ~0.15 s in) failed in CI when the trainer
# rank's header came after all 400 tokens (~1.3 s).
T, MAX_TOKENS, MAX_LEN, LANDING = 0.8, 400, 448, 24
PROMPTS = [[3, 4, 5, 13], [6, 7, 8, 9, 13], [10, 13], [11, 12, 13]]


def main() -> None:
    work = Path(sys.argv[1])
    load = sys.argv[2] if len(sys.argv) > 2 else "reload"
    cfg = Config()
    cfg.job.stage, cfg.inference.engine, cfg.world.inference_ranks = "rl", "vllm", 1
    world = init_world(cfg)
    tok = build_char_tokenizer(ALPHABET)
    args = flavour_args("debug", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    old, new = build_model(args, seed=1).eval(), build_model(args, seed=2).eval()
    if world.rank == 0:
        save_hf_folder(work / "old", args, old.state_dict())
        tok.save_pretrained(str(work / "old"))
    dist.barrier()
    layout = [(n, p.shape) for n, p in old.named_parameters()]
    bucket = 1024**2 // 2  # several buckets for the 3 MB debug model
    if world.rank == 0:
        group = join_store_group(*store_address(), "vllm_weights", 0, 2, "gloo", torch.device("cpu"), 120)
        sender_model = build_model(args, seed=2).eval()  # holds what the next push sends
        sender = WeightSender(sender_model, world.weight_group, 0, True, torch.float32, torch.device("cpu"),
                              bucket, group)
        assert len(sender.buckets) > 1
        for version, weights in ((1, new), (2, old)):
            sender_model.load_state_dict(weights.state_dict())
            # the engine starts the phase once this header is there; the buckets go when it loads the update
            sender.push(version)
        dist.barrier()
        sender.stop()
        dist.barrier()
        return
    engine = VLLMEngine(work / "old", max_num_seqs=8, max_len=MAX_LEN, temperature=T, top_p=1.0, seed=0,
                        dtype="float32", placement=vllm_placement(cfg, world), kv_cache_gib=1, ignore_eos=True,
                        weight_load=load)
    receiver = WeightReceiver(layout, world.weight_group, 0, torch.float32, torch.device("cpu"), bucket)
    engine.join_weight_group(*store_address(), 1, 2, "gloo", 120, [(n, list(s)) for n, s in layout], "float32", bucket)
    models = {0: old, 1: new, 2: old}
    engine.add(Request(0, PROMPTS[0], 8))  # warm-up: the first engine steps are slow (kernel set-up)
    while not engine.step(timeout=0.1):
        pass
    for phase, recompute in ((1, False), (2, True)):
        reqs = [Request(10 * phase + i, p, MAX_TOKENS) for i, p in enumerate(PROMPTS)]
        while not receiver.pending():  # the phase starts once the update's header is here: the trainer rank's
            engine.step(timeout=0.002)  # timing plays no part
        for r in reqs:
            engine.add(r)
        done: list[Request] = []
        updated = False
        while len(done) < len(reqs):
            # taken once a request has LANDING tokens: by count, not by time, so a slow machine cannot make it
            # miss every sequence (only a stall of ~1 s between this check and vLLM's pause could)
            if not updated and max(engine.tokens_in_flight(), default=0) >= LANDING and receiver.pending():
                kind, version = receiver.wait_header()
                assert kind == UPDATE and version == phase, (kind, version)
                engine.load_update(receiver, version, recompute)
                receiver.post()
                updated = True
            done += engine.step(timeout=0.002)
        assert updated, "the update arrived after every request had finished"
        split, min_gap = 0, float("inf")
        worst_before = worst_after = 0.0
        before_model, after_model = models[phase - 1], models[phase]
        for r in reqs:
            assert len(r.tokens) == MAX_TOKENS, len(r.tokens)
            m = r.versions.count(phase - 1)
            assert r.versions == [phase - 1] * m + [phase] * (MAX_TOKENS - m), r.versions
            split += 0 < m < MAX_TOKENS
            lp = torch.tensor(r.logprobs)
            worst_before = max(worst_before, (lp[:m] - full_logprobs(before_model, r.prompt_ids, r.tokens, T)[:m])
                               .abs().max().item() if m else 0.0)
            full = full_logprobs(after_model, r.prompt_ids, r.tokens, T)[m:]
            kept = logprobs_old_kv_then_new(before_model, after_model, r.prompt_ids, r.tokens, m, T) if m else full
            # m == 0: never scheduled before the update, so prefilled under the new weights
            ref, other = (full, kept) if recompute or m == 0 else (kept, full)
            if 0 < m < MAX_TOKENS:
                min_gap = min(min_gap, (lp[m:] - other).abs().max().item())
            worst_after = max(worst_after, (lp[m:] - ref).abs().max().item() if m < MAX_TOKENS else 0.0)
        print(f"phase {phase} recompute={recompute}: splits {[r.versions.count(phase - 1) for r in reqs]} "
              f"before={worst_before:.3g} after={worst_after:.3g} gap_to_the_other_mode={min_gap:.3g}", flush=True)
        assert split >= 1, "no request was in flight during the update"
        assert worst_before < 1e-4 and worst_after < 1e-4, "log-probs differ from the reference"
        assert min_gap > 1e-3, "keeping and recomputing the KV cache gave the same log-probs: the test proves nothing"
    assert engine.stats()[0] == 8 + 2 * len(PROMPTS) * MAX_TOKENS
    dist.barrier()
    kind, _ = receiver.wait_header()
    assert kind == STOP
    dist.barrier()
    engine.close()
    print("VLLM_JOB_OK", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # as the job does: never wait on peers (or vLLM's processes) after a failure
    dist.destroy_process_group()
