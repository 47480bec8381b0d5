"""How a vLLM worker loads an update: the "auto" decision, and the in-place loader's checks on a stand-in model
(the real vLLM model under every way is tested end to end in tests/e2e/test_vllm.py)."""

from __future__ import annotations

import types
from collections.abc import Iterable

import pytest
import torch

from pipelinerl_fsdp.inference.vllm_load import (
    UNPACKED_MAX_HIDDEN,
    InPlaceLoader,
    WeightAddresses,
    graphs_captured,
    resolve_weight_load,
)


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


class Served(torch.nn.Module):
    """A served model as vLLM holds it on GPU: a fused q/k/v weight loaded slice by slice (as
    `QKVParallelLinear.weight_loader` does, `narrow` then `copy_`) and a norm; `rebind`: the norm's loader gives it
    new storage instead of copying into it."""

    def __init__(self, rebind: bool = False) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 2), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        self.rebind = rebind

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, t in weights:
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, 2 * "qkv".index(name), 2).copy_(t)
            elif self.rebind:
                self.norm.data = t.clone()
            else:
                self.norm.data.copy_(t)
        return {"qkv", "norm"}


UPDATE = [("q", torch.full((2, 2), 1.0)), ("k", torch.full((2, 2), 2.0)), ("v", torch.full((2, 2), 3.0))]


def test_graphs_are_captured_only_on_gpu_without_enforce_eager():
    assert graphs_captured(on_gpu=True, enforce_eager=False)
    assert not graphs_captured(on_gpu=True, enforce_eager=True)
    assert not graphs_captured(on_gpu=False, enforce_eager=False)


def test_an_update_copied_in_place_keeps_every_address():
    m = Served()
    addresses = WeightAddresses(m)
    m.load_weights([*UPDATE, ("norm", torch.full((2,), 5.0))])
    addresses.check(3)
    assert torch.equal(m.qkv[4:], torch.full((2, 2), 3.0)) and torch.equal(m.norm, torch.full((2,), 5.0))


def test_a_loader_that_rebinds_a_parameter_fails_named_after_the_update():
    m = Served(rebind=True)
    addresses = WeightAddresses(m)
    m.load_weights([*UPDATE, ("norm", torch.full((2,), 5.0))])
    with pytest.raises(RuntimeError, match=r"version 3 left 1 of vLLM's parameters .*\['norm'\].*old weights"):
        addresses.check(3)
    m = Served()
    addresses = WeightAddresses(m)
    m.norm.data = m.norm.data.to(torch.float64)  # same values, other storage and dtype
    with pytest.raises(RuntimeError, match=r"torch.float32, \(2,\)\) -> \(\d+, torch.float64"):
        addresses.check(4)


def test_the_worker_checks_the_addresses_after_each_load():
    from pipelinerl_fsdp.inference.vllm_extension import WeightUpdateExtension

    for rebind in (False, True):
        m = Served(rebind=rebind)
        ext = WeightUpdateExtension()
        ext.model_runner = types.SimpleNamespace(requests={}, get_model=lambda m=m: m)
        ext._pl_load, ext._pl_inplace, ext._pl_addresses = (
            "inplace",
            InPlaceLoader(m, unpacked=False),
            WeightAddresses(m),
        )
        if rebind:
            with pytest.raises(RuntimeError, match="version 5 left 1 of vLLM's parameters"):
                ext._load(iter([("norm", torch.zeros(2))]), 5)
        else:
            assert ext._load(iter([("norm", torch.zeros(2))]), 5) == {}


def test_vllms_generic_loader_copies_into_the_parameters():
    # what every model's `load_weights` goes through (`AutoWeightsLoader._load_param`: the parameter's
    # `weight_loader`, else `default_weight_loader`, which copies into `param.data`)
    utils = pytest.importorskip("vllm.model_executor.models.utils")
    m = torch.nn.Module()
    m.layer = torch.nn.Linear(2, 3)
    m.norm = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    addresses = WeightAddresses(m)
    new = {"layer.weight": torch.randn(3, 2), "layer.bias": torch.randn(3), "norm": torch.randn(3)}
    assert utils.AutoWeightsLoader(m).load_weights(list(new.items())) == set(new)
    addresses.check(1)
    for name, t in new.items():
        assert torch.equal(m.get_parameter(name), t)


def test_a_partial_update_loads_its_linears_and_leaves_the_others_as_vllm_built_them():
    """A LoRA push loads only the targeted linears (`layers`): only those get a plain weight back, are checked as
    loaded and compute with the new values; a linear outside them keeps the kernel vLLM built over its weight
    (given a plain weight back, it would compute with uninitialised memory: no update fills it)."""
    m = Model()
    m.b.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # dropped by vLLM once packed
    kernel = m.b.cpu_linear
    new_a, x = torch.randn(4, 4), torch.randn(2, 4)
    InPlaceLoader(m, unpacked=True, layers={"a", "head"}).load([("a.weight", new_a)])
    torch.testing.assert_close(m.a(x), x @ new_a.T)
    torch.testing.assert_close(m.head(x), x @ new_a.T)
    assert m.b.cpu_linear is kernel and m.b.weight.numel() == 0  # untouched: not restored, not switched
    with pytest.raises(RuntimeError, match=r"left 1 linear weights unloaded.*'b'"):  # named, yet not loaded
        InPlaceLoader(Model(), unpacked=True, layers={"a", "b"}).load([("a.weight", new_a)])
    with pytest.raises(ValueError, match=r"would load \['c'\]: no such module"):
        InPlaceLoader(Model(), unpacked=True, layers={"a", "c"})
