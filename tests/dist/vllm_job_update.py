"""vLLM inside a torchrun job (engine core in its own process), exactly as the inference ranks run it: rank 0 plays
the first trainer rank (WeightSender, buckets over the store-built group), rank 1 runs `VLLMEngine` and takes
each update while requests are being
generated (once one of them has LANDING tokens).

Phase 1 (keep KV, `kv_max_age = -1`): engine starts with `old`, the update carries `new` (version 1). Phase 2
(recompute at every update, `kv_max_age = 0`): requests start under `new`, the update carries `old` again (version
2). Phase 3 (`kv_max_age = 1`): requests start under `old` (version 2), then two updates: version 3 (`third`), whose
caches are one version behind and kept, and version 4 (`new`), at which they are two behind and recomputed. For
every request the versions the engine reports must split the tokens exactly where the weights changed: log-probs
before the split match the old weights; after it they match "old-weight KV + new weights" (kept) or a full
recompute under the new weights. A split off by one token would mismatch, and so would weights loaded wrong (a
fused q/k/v slice in the wrong place, a CPU linear still computing with its old packed copy), or a cache kept where
it should have been recomputed. Prints VLLM_JOB_OK on success.

Run: torchrun --nproc-per-node 2 tests/dist/vllm_job_update.py WORK_DIR [LOAD]   (LOAD: inference.vllm_weight_load)
"""

import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (kv_reference)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kv_reference import full_logprobs, logprobs_old_kv_then_new  # noqa: E402
from pipelinerl_fsdp.config import Config  # noqa: E402
from pipelinerl_fsdp.inference.engine import Request  # noqa: E402
from pipelinerl_fsdp.inference.placement import vllm_placement  # noqa: E402
from pipelinerl_fsdp.inference.vllm_config import VLLMInferenceConfig
from pipelinerl_fsdp.inference.vllm_engine import VLLMEngine  # noqa: E402
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder  # noqa: E402
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET  # noqa: E402
from pipelinerl_fsdp.tokenizer import build_char_tokenizer  # noqa: E402
from pipelinerl_fsdp.transport.store_group import join_store_group, store_address  # noqa: E402
from pipelinerl_fsdp.transport.weights import STOP, UPDATE, WeightReceiver, WeightSender  # noqa: E402
from pipelinerl_fsdp.job.world import init_world  # noqa: E402

# Each update is taken once a request has generated LANDING tokens more than at the previous one (vLLM streams
# each step's output), with its header already here, so it lands mid-sequence whatever the machine's speed. Timing
# it instead failed in CI twice: phase 1's header sent ~0.15 s in came after all 400 tokens (~1.3 s); phase 3's
# second update, taken as soon as the trainer rank had pushed it, came after all 400 on a slow day. The trainer rank
# can push an update only once the engine has taken the one before (`WeightSender.push` waits for its buckets), so
# between phase 3's two updates vLLM is held (its scheduler paused, requests and caches kept) until the second
# header is here.
T, MAX_TOKENS, MAX_LEN, LANDING = 0.8, 300, 348, 24
PROMPTS = [[3, 4, 5, 13], [6, 7, 8, 9, 13], [10, 13], [11, 12, 13]]


def hold(engine: VLLMEngine, pause: bool) -> None:
    """Pause vLLM's scheduler (every request and its cache kept, as `VLLMEngine._update` does around a load) or
    resume it."""
    llm = engine.llm
    coro = llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False) if pause else llm.resume_generation()
    engine._call(coro, "pausing vLLM" if pause else "resuming vLLM")


def main() -> None:
    work = Path(sys.argv[1])
    load = sys.argv[2] if len(sys.argv) > 2 else "reload"
    cfg = Config(inference=VLLMInferenceConfig())  # the vLLM engine's own section (as load_config selects it)
    cfg.job.stage, cfg.world.inference_ranks = "rl", 1
    world = init_world(cfg)
    tok = build_char_tokenizer(ALPHABET)
    args = flavour_args("debug", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    old, new, third = (build_model(args, seed=s).eval() for s in (1, 2, 3))
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
        for version, weights in ((1, new), (2, old), (3, third), (4, new)):
            sender_model.load_state_dict(weights.state_dict())
            # the engine starts the phase once this header is there; the buckets go when it loads the update
            sender.push(version)
        dist.barrier()
        sender.stop()
        dist.barrier()
        return
    engine = VLLMEngine(work / "old", max_num_seqs=8, max_len=MAX_LEN, temperature=T, top_p=1.0, seed=0,
                        dtype="float32", placement=vllm_placement(cfg.inference, cfg.job.threads_per_rank, world), kv_cache_gib=1, ignore_eos=True,
                        weight_load=load)
    receiver = WeightReceiver(layout, world.weight_group, 0, torch.float32, torch.device("cpu"), bucket)
    engine.join_weight_group(*store_address(), 1, 2, "gloo", 120, [(n, list(s)) for n, s in layout], "float32", bucket)
    models = {0: old, 1: new, 2: old, 3: third, 4: new}
    engine.add(Request(0, PROMPTS[0], 8))  # warm-up: the first engine steps are slow (kernel set-up)
    while not engine.step(timeout=0.1):
        pass
    # phase, the versions its updates carry, inference.kv_max_age, and whether each update recomputes the caches
    phases = ((1, (1,), -1, (False,)), (2, (2,), 0, (True,)), (3, (3, 4), 1, (False, True)))
    n_tok = MAX_TOKENS
    for phase, versions, max_age, expect_recomputed in phases:
        reqs = [Request(10 * phase + i, p, n_tok) for i, p in enumerate(PROMPTS)]
        while not receiver.pending():  # the phase starts once the update's header is here: the trainer rank's
            engine.step(timeout=0.002)  # timing plays no part
        for r in reqs:
            engine.add(r)
        done: list[Request] = []
        recomputed: list[int] = []
        landing = LANDING
        while len(done) < len(reqs):
            # taken once a request has `landing` tokens: by count, not by time, so a slow machine cannot make it
            # miss every sequence (only a stall of ~1 s before vLLM's pause could)
            if len(recomputed) < len(versions) and max(engine.tokens_in_flight(), default=0) >= landing:
                kind, version = receiver.wait_header()  # here already: the phase began, or vLLM was held, for it
                assert kind == UPDATE and version == versions[len(recomputed)], (kind, version)
                recomputed.append(engine.load_update(receiver, version, max_age))
                receiver.post()
                if len(recomputed) < len(versions):  # held until the trainer rank's next header is here
                    hold(engine, True)
                    landing = max(engine.tokens_in_flight(), default=0) + LANDING
                    while not receiver.pending():
                        time.sleep(0.002)
                    hold(engine, False)
            done += engine.step(timeout=0.002)
        assert len(recomputed) == len(versions), "an update arrived after every request had finished"
        first = versions[0] - 1
        split, min_gap = 0, float("inf")
        worst_before = worst_after = 0.0
        held = [0] * len(versions)  # requests in flight at each update (sampled some tokens before it, not all)
        for r in reqs:
            assert len(r.tokens) == n_tok, len(r.tokens)
            bounds = [r.versions.count(first)]
            for v in versions[:-1]:
                bounds.append(bounds[-1] + r.versions.count(v))
            held = [h + (0 < b < n_tok) for h, b in zip(held, bounds)]
            m = bounds[0]
            expected = [first] * m
            for v, lo, hi in zip(versions, bounds, bounds[1:] + [n_tok]):
                expected += [v] * (hi - lo)
            assert r.versions == expected, r.versions
            split += 0 < m < n_tok
            lp = torch.tensor(r.logprobs)
            before_model = models[first]
            worst_before = max(worst_before, (lp[:m] - full_logprobs(before_model, r.prompt_ids, r.tokens, T)[:m])
                               .abs().max().item() if m else 0.0)
            # m == 0: never scheduled before the update, so prefilled under the new weights
            for i, (v, lo) in enumerate(zip(versions, bounds)):
                hi = bounds[i + 1] if i + 1 < len(bounds) else n_tok
                if lo == hi:
                    continue
                toks = r.tokens[:hi]
                full = full_logprobs(models[v], r.prompt_ids, toks, T)[lo:]
                if recomputed[i] or m == 0:
                    ref, other = full, None
                elif i == 0:  # the cache of the first segment kept: old-weight KV + these weights
                    ref = logprobs_old_kv_then_new(before_model, models[v], r.prompt_ids, toks, lo, T)
                    other = full
                else:
                    continue  # a cache of two older versions kept: checked through the next segment's recompute
                if other is not None and 0 < lo < n_tok:
                    min_gap = min(min_gap, (lp[lo:hi] - other).abs().max().item())
                worst_after = max(worst_after, (lp[lo:hi] - ref).abs().max().item())
        # vLLM recomputes every held request's cache, or none (a request scheduled but without a token yet is held)
        assert all(h >= 1 for h in held), ("an update came after every request had finished", held)
        for n, h, e in zip(recomputed, held, expect_recomputed):
            assert (h <= n <= len(PROMPTS)) if e else n == 0, (recomputed, held, expect_recomputed)
        print(f"phase {phase} kv_max_age={max_age} recomputed={recomputed}: splits "
              f"{[r.versions.count(first) for r in reqs]} before={worst_before:.3g} after={worst_after:.3g} "
              f"gap_to_the_other_mode={min_gap:.3g}", flush=True)
        assert split >= 1, "no request was in flight during the update"
        assert worst_before < 1e-4 and worst_after < 1e-4, "log-probs differ from the reference"
        if max_age < 0:
            assert min_gap > 1e-3, "keeping and recomputing the KV cache gave the same log-probs: proves nothing"
    assert engine.stats()[0] == 8 + len(PROMPTS) * n_tok * len(phases)
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
