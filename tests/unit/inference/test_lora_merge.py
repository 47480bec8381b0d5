"""LoRA on the engine side (inference/lora_merge.py): the merge of pushed adapters into W0, and a reference engine
after an adapter push against one opened on the merged weights."""

from __future__ import annotations

import copy
import dataclasses
import types
from collections import deque

import pytest
import torch

from pipelinerl_fsdp.config import InferenceConfig, JobConfig, LoRAConfig
from pipelinerl_fsdp.inference.engine import EngineSettings, Request
from pipelinerl_fsdp.inference.lora_merge import (
    VLLM_PACKED,
    AdapterMerge,
    base_placement,
    fused_module_name,
    loaded_weights,
    pack_into_slabs,
    place_base,
    read_base,
    slab_layout,
)
from pipelinerl_fsdp.inference.reference_engine import ReferenceEngine
from pipelinerl_fsdp.job.weight_sync import WeightSyncLayout, weight_sync_layout
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder
from pipelinerl_fsdp.models.lora import adapter_layout, adapter_parameters, apply_lora, merge_adapters, merged_weight
from pipelinerl_fsdp.transport import weights
from pipelinerl_fsdp.transport.weights import WeightSender

ARGS = flavour_args("debug", vocab_size=40)
L0 = "model.layers.0"


def adapters(cfg: LoRAConfig, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random non-zero factors (B != 0: a zero B merges to W0 and proves nothing) in the push layout."""
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(shape, generator=g) * 0.1) for n, shape in adapter_layout(ARGS, cfg)]


def base_weights(names: list[str], seed: int = 1) -> dict[str, torch.Tensor]:
    state = build_model(ARGS, seed=seed).state_dict()
    return {n: state[n].clone() for n in names}


def test_each_weight_is_bitwise_merged_weight_and_never_accumulates():
    cfg = LoRAConfig(enabled=True, rank=4, alpha=8.0)
    names = [n for n, _ in adapter_layout(ARGS, cfg)]
    base = base_weights(loaded_weights(names, {}))
    kept = {n: t.clone() for n, t in base.items()}
    merge = AdapterMerge(base, cfg.scaling, names)
    for seed in (1, 2):  # the second push merges from W0, not from the first push's weights
        pushed = dict(adapters(cfg, seed))
        out = dict(merge(list(pushed.items())))
        assert sorted(out) == sorted(base)  # unfused: exactly the targeted weights
        for w, t in out.items():
            a, b = pushed[w.replace(".weight", ".lora_A.weight")], pushed[w.replace(".weight", ".lora_B.weight")]
            assert torch.equal(t, merged_weight(kept[w], a, b, cfg.scaling))
            assert not torch.equal(t, kept[w])
    assert all(torch.equal(base[n], kept[n]) for n in base)  # W0 untouched


def test_a_partly_targeted_fused_group_also_loads_its_other_members_w0():
    """vLLM loads q/k/v into one `qkv_proj` and gate/up into `gate_up_proj`: targets q, v and gate also write k's
    and up's W0, so an in-place load into fresh fused storage leaves no slice unwritten."""
    cfg = LoRAConfig(enabled=True, rank=2, target_modules=["q_proj", "v_proj", "gate_proj"])
    names = [n for n, _ in adapter_layout(ARGS, cfg)]
    writes = loaded_weights(names, VLLM_PACKED)
    layer0 = [w.removeprefix(L0 + ".") for w in writes if w.startswith(L0 + ".")]
    assert layer0 == ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                      "mlp.gate_proj.weight", "mlp.up_proj.weight"]  # fmt: skip
    assert {fused_module_name(w, VLLM_PACKED) for w in writes if w.startswith(L0 + ".")} == {
        f"{L0}.self_attn.qkv_proj",
        f"{L0}.mlp.gate_up_proj",
    }
    assert loaded_weights(names, {}) == [adapter.replace(".lora_A", "") for adapter in names if ".lora_A." in adapter]
    base = base_weights(writes)
    out = list(AdapterMerge(base, cfg.scaling, names, VLLM_PACKED)(adapters(cfg, 3)))
    assert [n for n, _ in out] == writes  # each once, k after q (its group's first member), up after gate
    got = dict(out)
    for sibling in ("self_attn.k_proj.weight", "mlp.up_proj.weight"):
        assert torch.equal(got[f"{L0}.{sibling}"], base[f"{L0}.{sibling}"])
    assert not torch.equal(got[f"{L0}.self_attn.v_proj.weight"], base[f"{L0}.self_attn.v_proj.weight"])
    with pytest.raises(ValueError, match="no base weight for"):
        AdapterMerge({n: t for n, t in base.items() if "k_proj" not in n}, cfg.scaling, names, VLLM_PACKED)


def test_a_stream_out_of_layout_order_is_refused():
    cfg = LoRAConfig(enabled=True, rank=2, target_modules=["q_proj"])
    names = [n for n, _ in adapter_layout(ARGS, cfg)]
    merge = AdapterMerge(base_weights(loaded_weights(names, {})), cfg.scaling, names)
    pairs = adapters(cfg, 0)
    with pytest.raises(ValueError, match="does not follow its lora_A"):
        list(merge([pairs[1], pairs[0]]))
    with pytest.raises(ValueError, match="ends the update without its lora_B"):
        list(merge(pairs[:1]))


def test_w0_is_read_from_the_engines_folder_in_its_dtype(tmp_path):
    state = build_model(ARGS, seed=1).state_dict()
    save_hf_folder(tmp_path, ARGS, state)
    name = f"{L0}.mlp.up_proj.weight"
    got = read_base(tmp_path, [name], torch.bfloat16, torch.device("cpu"))
    assert list(got) == [name] and torch.equal(got[name], state[name].to(torch.bfloat16))
    with pytest.raises(KeyError, match="no tensor"):
        read_base(tmp_path, ["model.layers.9.mlp.up_proj.weight"], torch.float32, torch.device("cpu"))


class Wire:
    """The weight group in one process: the sender's bucket broadcasts are kept in order and the receiver's
    broadcasts take them (the 3-number header travels nowhere: the test drives the engine's update calls)."""

    def __init__(self) -> None:
        self.buckets: deque[torch.Tensor] = deque()

    class Done:
        def wait(self) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

        def get_future(self) -> types.SimpleNamespace:
            return types.SimpleNamespace(add_done_callback=lambda fn: fn(None))

    def broadcast(self, flat: torch.Tensor) -> Done:  # the sender's side (a store-built bucket group)
        self.buckets.append(flat.clone())
        return Wire.Done()

    def receive(self, tensor: torch.Tensor, src: int, group: object = None, async_op: bool = False) -> Done:
        if tensor.dtype != torch.long:  # a bucket (the header is int64)
            sent = self.buckets.popleft()
            # a broadcast moves bytes: a receive buffer of another dtype or size hangs or garbles it (NCCL), where
            # `copy_` would convert silently
            assert (tensor.dtype, tensor.shape) == (sent.dtype, sent.shape), (tensor.dtype, tensor.shape, sent)
            tensor.copy_(sent)
        return Wire.Done()


def settings(folder, lora: LoRAConfig | None, dtype: torch.dtype = torch.float32) -> EngineSettings:
    return EngineSettings(
        inference=InferenceConfig(engine="reference", max_num_seqs=4, temperature=0.0),
        timeout_s=60,
        debug=False,
        threads_per_rank=1,
        world=types.SimpleNamespace(weight_group=None, trainer_ranks=[0]),  # type: ignore[arg-type]
        model_path=str(folder),
        tokenizer_path=str(folder),
        max_len=32,
        stop_token_ids=[],
        dtype=dtype,
        device=torch.device("cpu"),
        seed=0,
        bucket_bytes=8 * 1024,  # several buckets of whole layers
        bucket_group_size=2,
        lora=lora,
    )


def greedy(engine: ReferenceEngine) -> list[tuple[list[int], list[float]]]:
    reqs = [Request(i, p, max_tokens=8) for i, p in enumerate([[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]])]
    for r in reqs:
        engine.add(r)
    while engine.num_unfinished():
        engine.step()
    return [(r.tokens, r.logprobs) for r in reqs]


def test_a_reference_engine_after_an_adapter_push_equals_one_opened_on_the_merged_weights(tmp_path, monkeypatch):
    """Trainer side: a LoRA model whose adapters (random, B != 0) the real `WeightSender` pushes in fp32; engine
    side: `ReferenceEngine.create` under `[lora]`, loading version 1 in flight (`load_update`) and version 2 staged
    (`stage_update` + `apply_staged`). After each, every weight and the greedy tokens and log-probs equal, bit for
    bit, those of a reference engine opened on an HF folder of `merge_adapters` (the same `merged_weight`)."""
    targets = ["q_proj", "v_proj", "up_proj", "down_proj"]
    # W0 "in host memory": on a CPU engine the same memory, through the code a GPU engine runs (`place_base`)
    cfg = LoRAConfig(enabled=True, rank=4, alpha=16.0, target_modules=targets, engine_base="host")
    base = build_model(ARGS, seed=1)
    save_hf_folder(tmp_path / "base", ARGS, base.state_dict())
    trained = copy.deepcopy(base)
    apply_lora(trained, cfg)
    wire = Wire()
    monkeypatch.setattr(weights.dist, "broadcast", wire.receive)
    monkeypatch.setattr(WeightSender, "_header", lambda self, kind, version: None)
    sender = WeightSender(
        trained, None, 0, True, torch.float32, torch.device("cpu"), 8 * 1024, wire, params=adapter_parameters(trained)
    )
    engine, receiver = ReferenceEngine.create(settings(tmp_path / "base", cfg))
    assert receiver.dtype == torch.float32 and len(receiver.layout.buckets) == len(sender.buckets) > 1
    plain = greedy(ReferenceEngine.open(settings(tmp_path / "base", None)))
    for version in (1, 2):
        with torch.no_grad():
            g = torch.Generator().manual_seed(version)
            for _, p in adapter_parameters(trained):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        sender.push(version)
        if version == 1:
            engine.load_update(receiver, version, kv_max_age=-1)
        else:
            engine.stage_update(receiver)
            engine.apply_staged(version)
        assert not wire.buckets  # the whole push was taken
        merged = merge_adapters({n: t.detach() for n, t in trained.state_dict().items()}, cfg)
        save_hf_folder(tmp_path / f"merged{version}", ARGS, merged)
        reference = ReferenceEngine.open(settings(tmp_path / f"merged{version}", None))
        for name, p in reference.params.items():
            assert torch.equal(engine.params[name], p), name
        got = greedy(engine)
        assert got == greedy(reference)  # tokens and log-probs, exactly
        assert got != plain  # the adapters changed the model


def test_w0_is_kept_beside_the_served_weights_or_pinned_in_host_memory_and_auto_never_reaches_an_engine():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert base_placement("device", cuda) == (cuda, False)
    assert base_placement("host", cuda) == (cpu, True)  # pinned: the per-update copies to the GPU run async
    assert base_placement("device", cpu) == (cpu, False)
    assert base_placement("host", cpu) == (cpu, False)  # one memory: nothing to pin
    with pytest.raises(ValueError, match=r"lora.engine_base = 'auto' reached an engine"):
        base_placement("auto", cpu)
    w = {"a.weight": torch.randn(3, 2)}
    placed = place_base(w, "host", cpu)
    assert torch.equal(placed["a.weight"], w["a.weight"]) and placed["a.weight"].device == cpu


def test_pinned_w0_is_packed_into_power_of_two_slabs_that_the_allocator_does_not_round_up():
    # sizes in bytes against 1 KiB slabs, offsets aligned to 256: 300 -> 512 used, 300 -> 512 more (slab 0 full),
    # 600 -> 768 in a new slab, 5000 (larger than a slab) -> a slab of its own of 8192 (the next power of two),
    # 200 -> 256: first fit, into slab 1 after the 768
    sizes, where = slab_layout([300, 300, 600, 5000, 200], slab_bytes=1024)
    assert sizes == [1024, 1024, 8192]
    assert where == [(0, 0), (0, 512), (1, 0), (2, 0), (1, 768)]
    assert all(n & (n - 1) == 0 for n in sizes)
    # the packed copies hold W0's values, as views of the slabs, and merge as the unpacked ones do
    cfg = LoRAConfig(enabled=True, rank=2, target_modules=["q_proj", "down_proj"])
    names = [n for n, _ in adapter_layout(ARGS, cfg)]
    g = torch.Generator().manual_seed(0)
    model = build_model(ARGS, seed=0)
    base = {w: model.state_dict()[w].to(torch.bfloat16) for w in loaded_weights(names, VLLM_PACKED)}
    packed = pack_into_slabs(base, pin=False, slab_bytes=4096)
    assert all(torch.equal(packed[n], base[n]) and packed[n].dtype == torch.bfloat16 for n in base)
    assert len({p.untyped_storage().data_ptr() for p in packed.values()}) < len(packed)  # views into shared slabs
    pairs = [(n, torch.randn(s, generator=g)) for n, s in adapter_layout(ARGS, cfg)]
    got = dict(AdapterMerge(packed, 2.0, names, VLLM_PACKED)(iter(pairs)))
    want = dict(AdapterMerge(base, 2.0, names, VLLM_PACKED)(iter(pairs)))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def gpu_lora_layout(cfg: LoRAConfig) -> WeightSyncLayout:
    """The weight sync an NCCL job decides for engines on its GPUs (reference engine in the rank's process, or
    vLLM in its own), `inference.dtype = "auto"`: bf16 engines."""
    world = types.SimpleNamespace(backend="nccl", inference_ranks=[1])
    return weight_sync_layout(JobConfig(), InferenceConfig(engine="reference"), world, cfg)  # type: ignore[arg-type]


def bucket_bytes(dtype: torch.dtype, sizes: list[int]) -> list[int]:
    return [n * torch.tensor([], dtype=dtype).element_size() for n in sizes]


def test_a_lora_push_to_a_bf16_engine_of_a_gpu_job_lands_bit_exactly(tmp_path, monkeypatch):
    """Under `[lora]` on a GPU job the engines serve bf16 while the adapters travel in fp32 (`push_dtype`): the
    trainer's buckets and the engine's receive buffers must agree on the dtype and the bytes of every bucket, or the
    first update hangs or garbles on the GPU (fp32 engines, as the other LoRA tests run, cannot tell them apart).
    The layout is the one such a job decides; the engine is built from it as `factory.build_engine` builds it (on
    CPU here, in bf16). After each push every adapted weight is, bit for bit, W0 (the folder's weight in bf16)
    merged with the trainer's exact fp32 factors, within bf16 rounding of the fp64 sum; factors rounded to bf16 on
    the way would change some of every weight; every other weight is untouched."""
    targets = ["q_proj", "v_proj", "up_proj", "down_proj"]
    cfg = LoRAConfig(enabled=True, rank=4, alpha=16.0, target_modules=targets, engine_base="device")
    layout = gpu_lora_layout(cfg)
    assert layout.engines_on_gpu and layout.dtype == torch.bfloat16 and layout.lora is cfg
    base = build_model(ARGS, seed=1)
    save_hf_folder(tmp_path, ARGS, base.state_dict())
    trained = copy.deepcopy(base)
    apply_lora(trained, cfg)
    wire = Wire()
    monkeypatch.setattr(weights.dist, "broadcast", wire.receive)
    monkeypatch.setattr(WeightSender, "_header", lambda self, kind, version: None)
    factors = adapter_parameters(trained)
    cpu = torch.device("cpu")
    sender = WeightSender(trained, None, 0, True, layout.push_dtype, cpu, 8 * 1024, wire, params=factors)
    engine, receiver = ReferenceEngine.create(settings(tmp_path, layout.lora, layout.dtype))
    assert {p.dtype for p in engine.params.values()} == {torch.bfloat16}
    sent = bucket_bytes(sender.dtype, sender.sizes)
    assert receiver.dtype == sender.dtype and bucket_bytes(receiver.dtype, receiver.layout.sizes) == sent
    assert len(sent) > 1
    w0 = {n: p.detach().clone() for n, p in engine.params.items()}
    for version in (1, 2):
        with torch.no_grad():
            g = torch.Generator().manual_seed(version)
            for _, p in factors:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        sender.push(version)
        engine.load_update(receiver, version, kv_max_age=-1)
        assert not wire.buckets and engine.version == version
        pushed = {n: p.detach() for n, p in factors}
        merged = 0
        for name, got in engine.params.items():
            a_name = name.replace(".weight", ".lora_A.weight")
            if a_name not in pushed:
                assert torch.equal(got, w0[name]), name
                continue
            a, b = pushed[a_name], pushed[name.replace(".weight", ".lora_B.weight")]
            assert torch.equal(got, merged_weight(w0[name], a, b, cfg.scaling)), name
            exact = w0[name].double() + cfg.scaling * (b.double() @ a.double())
            # round to nearest bf16: within half an ulp (2^-8 relative) of the fp64 sum, plus the fp32 sum's error
            assert ((got.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-6).all(), name
            rounded = merged_weight(w0[name], a.bfloat16(), b.bfloat16(), cfg.scaling)
            assert (rounded != got).float().mean() > 0.01, name  # what a bf16 stream would have loaded
            merged += 1
        assert merged == len(factors) // 2


def test_a_vllm_engine_under_lora_receives_the_pushes_in_the_trainers_dtype_and_merges_in_its_own(monkeypatch):
    """`VLLMEngine.create` of a bf16 GPU engine under `[lora]` (vLLM itself stubbed): the headers' receiver and the
    workers' receive buffers (built from the arguments the workers get, as `WeightUpdateExtension.join_weight_group`
    builds them) carry the trainer's `push_dtype` in buckets of the sender's bytes, and the workers read W0 in the
    engine's bf16."""
    from pipelinerl_fsdp.inference.vllm_config import VLLMInferenceConfig
    from pipelinerl_fsdp.inference.vllm_engine import VLLMEngine
    from pipelinerl_fsdp.transport.weights import BucketLayout

    cfg = LoRAConfig(enabled=True, rank=8, alpha=16.0, engine_base="host")
    layout = gpu_lora_layout(cfg)
    calls = []
    stub = types.SimpleNamespace(join_weight_group=lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(VLLMEngine, "open", classmethod(lambda cls, s: stub))
    monkeypatch.setattr(weights.dist, "broadcast", Wire().receive)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr("pipelinerl_fsdp.inference.vllm_engine.read_model_args", lambda path: ARGS)
    world = types.SimpleNamespace(weight_group=None, trainer_ranks=[0], inference_index=0, backend="nccl")
    s = dataclasses.replace(settings("unused", layout.lora, layout.dtype), world=world)
    s = dataclasses.replace(s, inference=VLLMInferenceConfig(max_num_seqs=4), device=torch.device("cuda"))
    engine, receiver = VLLMEngine.create(s)
    assert engine is stub and len(calls) == 1
    (_, _, _, _, _, _, names_and_shapes, dtype, bucket_size), kw = calls[0]
    workers = BucketLayout([(n, torch.Size(sh)) for n, sh in names_and_shapes], getattr(torch, dtype), bucket_size)
    trained = build_model(ARGS, seed=0)
    apply_lora(trained, cfg)
    factors = adapter_parameters(trained)
    cpu = torch.device("cpu")  # the trainer's bucket device does not change their sizes
    sender = WeightSender(trained, None, 0, True, layout.push_dtype, cpu, s.bucket_bytes, params=factors)
    sent = bucket_bytes(sender.dtype, sender.sizes)
    assert workers.dtype == receiver.dtype == sender.dtype and len(sent) > 1
    assert bucket_bytes(workers.dtype, workers.sizes) == bucket_bytes(receiver.dtype, receiver.layout.sizes) == sent
    assert kw["lora"]["dtype"] == "bfloat16" and kw["lora"]["scaling"] == cfg.scaling


def test_pinned_slabs_are_pinned_where_pinning_is_possible_and_refused_by_the_allocator_elsewhere():
    """`pack_into_slabs(pin=True)` (W0 in host memory of a GPU engine) on a machine that can pin: every copy is
    pinned and holds W0; where no pinned allocator exists (a CPU-only torch) the request reaches torch's allocator,
    which refuses it (pinning is never dropped silently)."""
    base = {"a.weight": torch.randn(5, 3).bfloat16(), "b.weight": torch.randn(7)}
    if torch.cuda.is_available():
        packed = pack_into_slabs(base, pin=True, slab_bytes=4096)
        assert all(packed[n].is_pinned() and torch.equal(packed[n], base[n]) for n in base)
    else:
        with pytest.raises(RuntimeError, match="pin"):
            pack_into_slabs(base, pin=True, slab_bytes=4096)
