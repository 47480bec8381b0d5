"""benchmarks/rl_step_speed.py's pure parts: the RL length mix and the exact FLOP count of a packed step."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.rl_step_speed import SHAPES, documents, peak_tflops, rl_samples, step_flops
from pipelinerl_fsdp.config import LoRAConfig
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.models.lora import init_adapters
from pipelinerl_fsdp.training.policy import adapt


def test_the_length_mix_has_short_prompts_and_a_long_tail_within_the_budget():
    samples = rl_samples(random.Random(0), 200_000, 32768, 8192, 1000)
    prompts = [len(s.prompt_ids) for s in samples]
    completions = sorted(len(s.completion_ids) for s in samples)
    assert sum(prompts) + sum(completions) >= 200_000 and max(prompts) <= 512
    assert 16 <= completions[0] and completions[-1] <= 8192
    median = completions[len(completions) // 2]
    assert 300 < median < 1200 and completions[int(0.95 * len(completions))] > 3 * median  # a long tail
    assert sum(s.loss_weight for s in samples) == pytest.approx(1.0)
    assert all(s.versions[-1] == 5 and set(s.versions) <= {4, 5} for s in samples)


def test_step_flops_count_each_part_at_the_positions_it_runs():
    args = flavour_args("debug")  # hidden 128, MLP 384, 4 layers, 4 heads of 32, 2 kv heads, vocab 32
    f = step_flops(args, [3, 5], head_tokens=4)
    block = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 384
    assert f["blocks"] == 6 * 4 * block * 8
    assert f["attention"] == 12 * 4 * 128 * (6 + 15)  # 3(4)/2 + 5(6)/2 causal pairs, heads x head_dim = 128
    assert f["head"] == 6 * 128 * 32 * 4
    # the blocks' matrix products are 6N x tokens for the blocks' parameters, biases and norms aside
    big = SHAPES["smollm2-135m"]
    tokens = 4096
    blocks = step_flops(big, [tokens], 0)["blocks"]
    embed = big.vocab_size * big.hidden_size
    assert blocks == pytest.approx(6 * (big.num_params() - embed) * tokens, rel=1e-3)
    assert big.num_params() == pytest.approx(134.5e6, rel=0.01)  # SmolLM2-135M


def test_documents_are_read_from_the_restarting_positions():
    assert documents(torch.tensor([[0, 1, 2, 0, 1, 0]])) == [3, 2, 1]


def test_lora_step_flops_freeze_the_base_and_add_the_adapters():
    """The debug shape (hidden 128, MLP 384, 4 layers, 4 heads of 32, 2 kv heads, vocab 32), rank 2, documents of 3
    and 5 positions, the head at 4: every number below worked out by hand."""
    f = step_flops(flavour_args("debug"), [3, 5], head_tokens=4, lora_rank=2)
    # block products q 16,384 + k, v 2 x 8,192 + o 16,384 + MLP 3 x 49,152 = 196,608; frozen: 4 x 196,608 x 4 layers
    # x 8 tokens = 25,165,824; the first layer's q, k, v get no input gradient: 2 x 128 x (128 + 64 + 64) x 8 = 524,288
    assert f["blocks"] == 24_641_536
    # (in + out) over the seven linears: q 256, k 192, v 192, o 256, gate 512, up 512, down 512 = 2,432 per layer;
    # 6 x 2 x 2,432 x 4 x 8 = 933,888, less the first layer's A input gradients of q, k, v: 2 x 2 x 128 x 3 x 8
    assert f["adapters"] == 933_888 - 12_288
    assert f["head"] == 4 * 128 * 32 * 4  # frozen: forward and input gradient only
    assert f["attention"] == 129_024  # unchanged: 12 x 4 layers x 128 x 21 pairs
    assert "adapters" not in step_flops(flavour_args("debug"), [3, 5], head_tokens=4)


@pytest.mark.parametrize("rank", [0, 4])
def test_the_matrix_product_flops_are_what_autograd_runs(rank):
    """torch's FLOP counter over a real forward + backward of the debug model (the head at every position, full
    fine-tuning or LoRA as the trainer builds it): its matrix products equal blocks + head (+ adapters) exactly, so
    the frozen products' missing weight gradients and the first layer's q, k, v input gradients are as counted."""
    from torch.utils.flop_counter import FlopCounterMode

    args = flavour_args("debug")
    model = build_model(args, seed=0)
    if rank:
        adapt(model, LoRAConfig(enabled=True, rank=rank), torch.float32)
        init_adapters(model, 0)
    ids = torch.randint(0, args.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(ids).sum().backward()
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    f = step_flops(args, [16], head_tokens=16, lora_rank=rank)
    assert counted["aten.mm"] + counted.get("aten.addmm", 0) == f["blocks"] + f["head"] + f.get("adapters", 0)


@pytest.mark.parametrize(
    "name, tflops",
    [  # NVIDIA's data sheets, dense bf16 (half the sparse figure)
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA A10G", None),
    ],
)
def test_the_peak_is_the_gpus_own_the_pcie_and_nvl_cards_before_the_sxm_ones(monkeypatch, name, tflops):
    """`peak_tflops` matches the GPU's name against the table in order: "H100 PCIe" must win over "H100" (which
    it contains), or the MFU the GPU check reports on a PCIe card is taken against the SXM peak (989 for 756)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(torch.device("cuda", 0), None) == tflops
    assert peak_tflops(torch.device("cuda", 0), 123.0) == 123.0 and peak_tflops(torch.device("cpu"), None) is None
