"""vLLM behind the reference engine's interface (`add`, `step`, `load_weights`, `set_version`), in-process.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and `step()` advances it by exactly
one engine step, so an update loaded between two steps takes effect for every token sampled after it, and the
tokens that a step returns carry the version of the weights that step ran with: versions are exact by
construction. In-flight loads go through vLLM's `reload_weights` (on CPU, vLLM repacks linear weights after
loading, so copying into parameters would silently do nothing), which keeps the KV cache of running requests.

Not yet usable inside the torchrun job: an in-process engine adopts the already-initialised default process
group (FIELD_NOTES); the job integration runs the engine core in its own process with a worker extension that
joins the weight group (issue 4).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pipelinerl_fsdp.inference.engine import Request


class VLLMEngine:
    def __init__(self, model_path: str | Path, max_num_seqs: int, max_len: int, temperature: float,
                 top_p: float = 1.0, seed: int = 0, dtype: str = "float32", enforce_eager: bool = True,
                 ignore_eos: bool = False) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM, SamplingParams

        self._sampling_params = SamplingParams
        # processed_logprobs: log-probs under the sampling distribution (after temperature / top-p), which is
        # what the trainer's importance weights need; vLLM's default (raw) ignores the temperature.
        self.llm = LLM(model=str(model_path), dtype=dtype, max_model_len=max_len, max_num_seqs=max_num_seqs,
                       seed=seed, enforce_eager=enforce_eager, logprobs_mode="processed_logprobs")
        self.core = self.llm.llm_engine
        self.temperature, self.top_p, self.seed, self.ignore_eos = temperature, top_p, seed, ignore_eos
        self.version = 0
        self.requests: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        params = self._sampling_params(temperature=self.temperature, top_p=self.top_p,
                                       max_tokens=request.max_tokens, logprobs=0, ignore_eos=self.ignore_eos,
                                       seed=self.seed * 1_000_003 + request.request_id)
        rid = str(request.request_id)
        self.core.add_request(rid, {"prompt_token_ids": list(request.prompt_ids)}, params)
        self.requests[rid] = request

    def num_unfinished(self) -> int:
        return len(self.requests)

    def step(self) -> list[Request]:
        """One engine step; new tokens are tagged with the current version. Returns finished requests."""
        finished = []
        for out in self.core.step():
            req = self.requests[out.request_id]
            comp = out.outputs[0]
            n_old = len(req.tokens)
            new = list(comp.token_ids)[n_old:]
            req.tokens.extend(new)
            req.logprobs.extend(lp[t].logprob for lp, t in zip(comp.logprobs[n_old:], new))
            req.versions.extend([self.version] * len(new))
            if out.finished:
                req.finished = comp.finish_reason == "stop"
                finished.append(req)
                del self.requests[out.request_id]
        return finished

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors between two steps (whole layers together: q/k/v and gate/up are fused)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named, "is_checkpoint_format": True})

    def set_version(self, version: int) -> None:
        self.version = version
