"""Waits on vLLM's client loop: an answer, a dead engine core or the deadline, whichever comes first, each named."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from pipelinerl_fsdp.inference.vllm_engine import VLLMEngine


@pytest.fixture
def engine():
    """A VLLMEngine's waiting machinery (its client loop) around a fake AsyncLLM, without starting vLLM."""
    e = VLLMEngine.__new__(VLLMEngine)
    e.loop = asyncio.new_event_loop()
    thread = threading.Thread(target=e.loop.run_forever, daemon=True)
    thread.start()
    e.timeout_s = 30.0
    e.llm = SimpleNamespace(errored=False, dead_error=RuntimeError("EngineDeadError"))
    yield e

    async def cancel_all() -> None:
        for t in asyncio.all_tasks():
            if t is not asyncio.current_task():
                t.cancel()

    asyncio.run_coroutine_threadsafe(cancel_all(), e.loop).result(5)
    e.loop.call_soon_threadsafe(e.loop.stop)
    thread.join(5)


async def forever() -> None:
    await asyncio.sleep(3600)


async def answer() -> int:
    await asyncio.sleep(0.05)
    return 7


def test_a_call_returns_its_result(engine):
    assert engine._call(answer(), "a test call") == 7


def test_a_call_pending_when_the_engine_core_dies_fails_within_a_second(engine):
    # vLLM never answers a call that was in flight when its core died: without the liveness check this waits forever
    threading.Timer(0.3, lambda: setattr(engine.llm, "errored", True)).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="engine core died during the update to version 3") as info:
        engine._call(forever(), "the update to version 3")
    assert time.monotonic() - t0 < 1.5
    assert "EngineDeadError" in str(info.value.__cause__)


def test_a_hung_engine_core_meets_the_deadline_with_a_name(engine):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"for 1 s \(world.timeout_s\) during receiving an update"):
        engine._call(forever(), "receiving an update", timeout=1.0)
    assert 0.9 < time.monotonic() - t0 < 2.5


def test_the_shutdown_call_does_not_check_liveness(engine):
    engine.llm.errored = True  # shutting down marks the client errored: the shutdown itself must still complete
    assert engine._call(answer(), "the engine's shutdown", check_alive=False) == 7


def test_the_cpu_kv_cache_is_sized_from_the_config():
    from pipelinerl_fsdp.inference.vllm_options import kv_cache_gib_needed
    from pipelinerl_fsdp.models import ModelArgs

    # SmolLM2-135M's shape: 30 layers, 3 KV heads of 64 -> 46,080 bytes per token in fp32
    smol = ModelArgs(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
    gib = kv_cache_gib_needed(smol, max_num_seqs=16, max_len=1000, dtype_bytes=4)
    assert gib * 2**30 == 2 * 16 * 1024 * 46_080  # whole 128-token blocks, twice over
    assert kv_cache_gib_needed(smol, 16, 1025, 4) > gib  # one more token: one more block per sequence
    # the default job's tiny model: the 64 MiB floor, not the fixed 1 GiB of old
    tiny = ModelArgs(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    assert kv_cache_gib_needed(tiny, 64, 24, 4) == 64 / 1024


def test_requests_ask_vllm_for_token_ids_and_sampled_logprobs_only():
    pytest.importorskip("vllm")
    from pipelinerl_fsdp.inference.engine import Request
    from pipelinerl_fsdp.inference.vllm_options import sampling_params

    p = sampling_params(Request(5, [1, 2], 9), temperature=0.7, top_p=0.9, seed=3, ignore_eos=False, stop_token_ids=[2])
    # no text: vLLM's client would otherwise detokenize every new token on the inference rank's core
    assert p.detokenize is False
    assert p.logprobs == 0 and p.max_tokens == 9 and p.stop_token_ids == [2]
    assert p.seed == 3 * 1_000_003 + 5  # per request: a request's sampling does not depend on its batch
