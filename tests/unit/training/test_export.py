"""Exports of a LoRA policy sharded by FSDP2 (gloo, CPU): the PEFT adapter folder gathered from the shards holds the
full factors, the merged folder (`lora.export_merged`) is `merge_adapters` of the full model and loads in our
loader and in transformers with the adapted model's logits; run lists and evaluation tools find both. The same
on 1 rank (in this process) and on 2 ranks (factors split unevenly across them)."""

from __future__ import annotations

import dataclasses
import json
import socket
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipelinerl_fsdp.checkpoint_layout import exported_policies
from pipelinerl_fsdp.config import LoRAConfig, TrainerConfig
from pipelinerl_fsdp.models import build_model, flavour_args, load_hf_model, save_hf_folder
from pipelinerl_fsdp.models.lora import adapter_parameters, apply_lora, merge_adapters
from pipelinerl_fsdp.models.peft_io import MERGED, loadable_policy, read_adapter_folder
from pipelinerl_fsdp.tokenizer import build_char_tokenizer

ARGS = flavour_args("debug-llama", vocab_size=32, num_hidden_layers=2)
# rank 3: the 3 rows of every lora_A split 2 + 1 over two ranks
LORA = LoRAConfig(enabled=True, rank=3, alpha=6.0, target_modules=["k_proj", "o_proj", "up_proj", "down_proj"])


def full_value(name: str, shape: torch.Size) -> torch.Tensor:
    """The trained value every test gives a factor: random, non-zero, the same in every process."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1


def export_on_rank(
    rank: int, size: int, init: str, base: Path, out: Path, lora: LoRAConfig, param_dtype: str = "auto"
) -> None:
    """One trainer rank: load the base sharded with adapters (`load_sharded`; the frozen base stored in
    `param_dtype`), set the factors to `full_value` (each rank its own rows), export as the job does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from pipelinerl_fsdp.job.world import World
    from pipelinerl_fsdp.training.export import export_policy
    from pipelinerl_fsdp.training.policy import load_sharded

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))
    world = World(rank, size, rank, size, torch.device("cpu"), "gloo", list(range(size)), [], None, mesh, None, None)
    model = load_sharded(base, world, TrainerConfig(param_dtype=param_dtype), lora, seed=0)
    with torch.no_grad():
        for name, p in adapter_parameters(model):
            assert isinstance(p, DTensor)  # really sharded by FSDP2
            p.to_local().copy_(distribute_tensor(full_value(name, p.shape), mesh, p.placements).to_local())
    export_policy(model, out, world, build_char_tokenizer("0123456789+="), str(base))


def _worker(rank: int, port: int, base: Path, out: Path, lora: LoRAConfig) -> None:
    try:
        export_on_rank(rank, 2, f"tcp://127.0.0.1:{port}", base, out, lora)
    finally:
        dist.destroy_process_group()


@pytest.fixture
def base(tmp_path: Path) -> Path:
    folder = tmp_path / "base"
    save_hf_folder(folder, ARGS, build_model(ARGS, seed=0).state_dict())
    return folder


def adapted_reference(base: Path, lora: LoRAConfig) -> torch.nn.Module:
    """The adapted model unsharded, in this process: the base with every factor at `full_value`."""
    model = load_hf_model(base)
    apply_lora(model, lora)
    with torch.no_grad():
        for name, p in adapter_parameters(model):
            p.copy_(full_value(name, p.shape))
    return model.eval()


def check_export(out: Path, base: Path, lora: LoRAConfig) -> None:
    reference = adapted_reference(base, lora)
    cfg, tensors, base_path = read_adapter_folder(out)
    assert (cfg.rank, cfg.alpha, cfg.target_modules) == (lora.rank, lora.alpha, lora.target_modules)
    assert base_path == str(base)
    names = [n for n, _ in adapter_parameters(reference)]
    assert sorted(tensors) == sorted(names) and len(names) == 2 * 4 * ARGS.num_hidden_layers
    for name, p in adapter_parameters(reference):
        assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], p), name
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    merged = out / MERGED
    assert merged.is_dir() == lora.export_merged
    if not lora.export_merged:
        return
    assert (merged / "tokenizer_config.json").is_file() and loadable_policy(out) == merged
    ours = load_hf_model(merged).eval()
    expect = merge_adapters(reference.state_dict(), lora)
    assert set(ours.state_dict()) == set(expect)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, expect[k]), k  # the fp32 base merged with the same formula: bit for bit
    ids = torch.randint(0, ARGS.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        adapted, from_ours = reference(ids), ours(ids)
        plain = load_hf_model(base).eval()(ids)
    torch.testing.assert_close(from_ours, adapted, atol=2e-5, rtol=1e-5)  # x (W + sBA)^T against x W^T + s x A^T B^T
    assert (adapted - plain).abs().max() > 1e-2
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, adapted, atol=2e-5, rtol=1e-5)


def test_one_rank_exports_the_adapters_and_the_merged_model(tmp_path, base):
    lora = dataclasses.replace(LORA, export_merged=True)
    run = tmp_path / "run"
    try:
        export_on_rank(0, 1, f"file://{tmp_path}/.rendezvous", base, run / "final", lora)
        export_on_rank(0, 1, "", base, run / "exports" / "step-0000002", dataclasses.replace(lora, export_merged=False))
        # full fine-tuning: the plain HF export, unchanged
        from pipelinerl_fsdp.job.world import World
        from pipelinerl_fsdp.training.export import export_policy

        world = World(0, 1, 0, 1, torch.device("cpu"), "gloo", [0], [], None, None, None, None)
        export_policy(load_hf_model(base), tmp_path / "plain", world, build_char_tokenizer("01"), str(base))
    finally:
        dist.destroy_process_group()
    check_export(run / "final", base, lora)
    check_export(run / "exports" / "step-0000002", base, dataclasses.replace(lora, export_merged=False))
    assert [s for s, _ in exported_policies(run, 10)] == [2, 10]  # the adapter-only final/ is listed too
    assert (tmp_path / "plain" / "config.json").is_file() and not (tmp_path / "plain" / MERGED).exists()
    assert loadable_policy(tmp_path / "plain") == tmp_path / "plain"
    # an adapter-only export merged on first use equals the trainer's merged export, bit for bit
    merged_later = loadable_policy(run / "exports" / "step-0000002")
    a, b = load_hf_model(merged_later).state_dict(), load_hf_model(run / "final" / MERGED).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_gather_their_shards_into_one_adapter_folder(tmp_path, base):
    lora = dataclasses.replace(LORA, export_merged=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, base, tmp_path / "final", lora)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    check_export(tmp_path / "final", base, lora)
    assert json.loads((tmp_path / "final" / "adapter_config.json").read_text())["r"] == 3


def test_a_bf16_frozen_base_is_merged_in_fp32(tmp_path, base):
    """On a GPU the frozen base is stored in bf16: the merged export adds s B A to W0 upcast to fp32 (the update
    is not rounded to bf16), and the weights without adapters are the bf16 values, exactly."""
    from pipelinerl_fsdp.models.lora import merged_weight

    lora = dataclasses.replace(LORA, export_merged=True)
    try:
        export_on_rank(0, 1, f"file://{tmp_path}/.rendezvous", base, tmp_path / "final", lora, "bfloat16")
    finally:
        dist.destroy_process_group()
    merged = load_hf_model(tmp_path / "final" / MERGED).state_dict()
    w0 = {k: v.to(torch.bfloat16).float() for k, v in load_hf_model(base).state_dict().items()}
    _, adapters, _ = read_adapter_folder(tmp_path / "final")
    for name, a in adapters.items():
        if ".lora_A." in name:
            target = name.split(".lora_A.")[0] + ".weight"
            b = adapters[name.replace(".lora_A.", ".lora_B.")]
            assert torch.equal(merged[target], merged_weight(w0[target], a, b, lora.scaling)), target
            rounded = merged_weight(w0[target].to(torch.bfloat16), a, b, lora.scaling).float()
            assert not torch.equal(merged[target], rounded)  # what merging in the stored dtype would have given
            w0.pop(target)
    assert all(torch.equal(merged[k], v) for k, v in w0.items() if k in merged)
