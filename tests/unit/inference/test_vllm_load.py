"""How a vLLM worker loads an update: the "auto" decision, and the in-place loader's checks on a stand-in model
(the real vLLM model under every way is tested end to end in tests/e2e/test_vllm.py)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from pipelinerl_fsdp.inference.vllm_load import UNPACKED_MAX_HIDDEN, InPlaceLoader, resolve_weight_load


def test_auto_is_inplace_on_gpu_whatever_the_size():
    assert resolve_weight_load("auto", 128, on_gpu=True) == "inplace"
    assert resolve_weight_load("auto", 4096, on_gpu=True) == "inplace"


def test_auto_on_cpu_unpacks_small_hidden_sizes_only():
    assert resolve_weight_load("auto", 128, on_gpu=False) == "unpacked"
    assert resolve_weight_load("auto", UNPACKED_MAX_HIDDEN, on_gpu=False) == "unpacked"
    assert resolve_weight_load("auto", UNPACKED_MAX_HIDDEN + 1, on_gpu=False) == "inplace"
    assert resolve_weight_load("auto", 768, on_gpu=False) == "inplace"


def test_an_explicit_way_is_kept_and_a_wrong_one_is_named():
    for load in ("reload", "inplace", "unpacked"):
        assert resolve_weight_load(load, 128, on_gpu=False) == load
    with pytest.raises(ValueError, match="inference.vllm_weight_load: 'fast'"):
        resolve_weight_load("fast", 128, on_gpu=False)


class Linear(torch.nn.Module):
    """A CPU linear as vLLM leaves it: a plain weight and a `cpu_linear` kernel that ignores it (a stale pack)."""

    def __init__(self, n: int, weight: torch.nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight if weight is not None else torch.nn.Parameter(torch.zeros(n, n), requires_grad=False)
        stale = self.weight.detach().clone()
        self.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, stale, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cpu_linear(x, self.weight, None)


class Model(torch.nn.Module):
    """Two linears, the second tied to the first's weight (a tied LM head); `load_weights` as vLLM's: copies
    each named tensor into its parameter and returns the names it loaded."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.a = Linear(n)
        self.head = Linear(n, self.a.weight)
        self.b = Linear(n)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, t in weights:
            self.get_parameter(name).data.copy_(t)
            loaded.add(name)
        return loaded


def test_unpacked_computes_with_the_loaded_weights_tied_head_included():
    m = Model()
    new_a, new_b = torch.randn(4, 4), torch.randn(4, 4)
    x = torch.randn(2, 4)
    assert torch.equal(m.a(x), torch.zeros(2, 4))  # the stale kernel
    InPlaceLoader(m, unpacked=True).load([("a.weight", new_a), ("b.weight", new_b)])
    torch.testing.assert_close(m.a(x), x @ new_a.T)
    torch.testing.assert_close(m.head(x), x @ new_a.T)  # loaded through the embedding's name, same storage
    torch.testing.assert_close(m.b(x), x @ new_b.T)


def test_a_linear_left_out_of_the_update_is_an_error_not_a_stale_kernel():
    m = Model()
    with pytest.raises(RuntimeError, match=r"left 1 linear weights unloaded.*'b'"):
        InPlaceLoader(m, unpacked=True).load([("a.weight", torch.randn(4, 4))])
