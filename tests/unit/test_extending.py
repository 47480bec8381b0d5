"""docs/extending.md's examples, run as written: a new engine is its module plus one registry entry, a new loss
is one module; the config accepts them by name and the job's code finds them."""

from __future__ import annotations

import copy
import re
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

from pipelinerl_fsdp.config import ConfigError
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.engine_kinds import ENGINE_KINDS, EngineKind, engine_kind
from pipelinerl_fsdp.inference.engine import Request
from pipelinerl_fsdp.inference.factory import engine_class
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.rl import objectives
from pipelinerl_fsdp.rl.loss import LossInput, policy_loss

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def block(first_line: str) -> str:
    """The docs' python block whose first line is `first_line`."""
    for code in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        if code.startswith(first_line + "\n"):
            return code
    raise AssertionError(f"docs/extending.md has no python block starting with {first_line!r}")


def test_the_docs_engine_example_is_selected_by_name_and_generates(tmp_path, monkeypatch):
    pkg = tmp_path / "my_engines"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "counting.py").write_text(block("# my_engines/counting.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"inference\.engine = 'counting' is not one of 'reference', 'vllm'"):
        load_config(["--inference.engine=counting"])
    with mock.patch.dict(ENGINE_KINDS):
        exec(block("# the entry in pipelinerl_fsdp/engine_kinds.py ENGINE_KINDS"), {
            "ENGINE_KINDS": ENGINE_KINDS, "EngineKind": EngineKind})  # fmt: skip
        cfg = load_config(["--config", "arithmetic", "--inference.engine=counting"])
        kind = engine_kind(cfg.inference)
        cls = engine_class(kind)
    assert cls.__name__ == "CountingEngine" and not kind.own_processes
    args = flavour_args("debug", vocab_size=32)
    old, new = build_model(args, seed=1), build_model(args, seed=2)
    engine = cls(copy.deepcopy(old), max_num_seqs=2, max_len=32, eos_ids=[], temperature=1.0, seed=0)
    req = Request(0, [3, 4, 5], max_tokens=6)
    engine.add(req)
    for _ in range(3):
        engine.step()

    class Receiver:  # the broadcast, as the weight group would deliver it
        def receive_buckets(self) -> None:
            with torch.no_grad():
                for name, p in engine.params.items():
                    p.copy_(new.state_dict()[name])

    assert engine.load_update(Receiver(), 1, 0) == 1  # kv_max_age 0: the request in flight is recomputed
    while engine.num_unfinished():
        engine.step()
    assert engine.updates == 1 and req.versions == [0, 0, 0, 1, 1, 1]


def test_the_docs_loss_example_registers_and_matches_reinforce_on_policy():
    code = block("# pipelinerl_fsdp/rl/objectives/plain_pg.py")
    module = types.ModuleType("plain_pg")  # dataclasses look their module up in sys.modules
    with mock.patch.dict(objectives.OBJECTIVES), mock.patch.dict(objectives.CONFIGS), mock.patch.dict(sys.modules):
        sys.modules["plain_pg"] = module
        exec(code, module.__dict__)
        cfg = load_config(["--loss.name=plain_pg", "--loss.scale=2.0"])
        torch.manual_seed(0)
        logp = (torch.randn(10) - 2).requires_grad_()
        adv, mask, weight = torch.randn(10), torch.ones(10), torch.full((10,), 0.25)
        grads = {}
        for kind, behaviour in (
            ("plain_pg", logp.detach()),
            ("reinforce_tis", logp.detach()),
            ("off", logp.detach() - 1),
        ):
            logp.grad = None
            loss_cfg = cfg.loss if kind != "reinforce_tis" else objectives.CONFIGS["reinforce_tis"]()
            loss, _ = policy_loss(logp, LossInput(mask, behaviour, adv, weight), loss_cfg)
            loss.backward()
            grads[kind] = logp.grad.clone()
    assert (cfg.loss.name, cfg.loss.scale) == ("plain_pg", 2.0)
    torch.testing.assert_close(grads["plain_pg"], 2 * grads["reinforce_tis"])  # on-policy: rho = 1; its own key
    torch.testing.assert_close(grads["off"], grads["plain_pg"])  # it ignores rho (what makes it on-policy only)
    with pytest.raises(ConfigError, match=r"loss\.name = 'plain_pg' is not one of 'cispo', 'dapo'"):
        load_config(["--loss.name=plain_pg"])
