"""docs/extending.md's examples, run as written: a new engine is its module plus one registry entry, a new loss
is one module; the config accepts them by name and the job's code finds them. A new metric is three lines added to
the package: applied to a copy of it, the engines count the number, the wire carries it and the step's metric is
its rate."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
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


def blocks(text: str | None = None) -> list[str]:
    """The python blocks of docs/extending.md (or of `text`)."""
    return re.findall(r"```python\n(.*?)```", text if text is not None else DOC.read_text(), re.S)


def block(first_line: str) -> str:
    """The docs' python block whose first line is `first_line`."""
    for code in blocks():
        if code.startswith(first_line + "\n"):
            return code
    raise AssertionError(f"docs/extending.md has no python block starting with {first_line!r}")


def section(title: str) -> str:
    """The text of the docs' section `## title`, up to the next one."""
    text = DOC.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def apply_insertion(root: Path, code: str) -> None:
    """A block of the form "# path", an existing line of that file, then the lines to add under it: added to the
    copy of the package under `root`."""
    header, anchor, *new = code.rstrip("\n").split("\n")
    path = root / header.removeprefix("# ")
    lines = path.read_text().split("\n")
    at = [i for i, line in enumerate(lines) if line == anchor]
    assert len(at) == 1, f"{path.name}: the block's first line occurs {len(at)} times, not once: {anchor!r}"
    path.write_text("\n".join(lines[: at[0] + 1] + new + lines[at[0] + 1 :]))


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


# Run in a fresh interpreter on the patched copy: the engines (the inference loop over test_inference_modes's fake
# engine and trainer) count prompt tokens; the count travels in a rollout message; the trainer's metric is its rate.
METRIC_CHECK = """
import pipelinerl_fsdp
import test_inference_modes as modes
from pipelinerl_fsdp.records import total
from pipelinerl_fsdp.rl.loss import LossStats
from pipelinerl_fsdp.rl.step_metrics import StepTimes, step_metrics
from pipelinerl_fsdp.samples import EngineStats, Sample
from pipelinerl_fsdp.transport.rollouts import decode_message, encode_message
from pipelinerl_fsdp.records import values

admitted, seen = [0], []
add, put = modes.FakeEngine.add, modes.FakeTrainer.put
def counting_add(self, request):
    admitted[0] += len(request.prompt_ids)
    add(self, request)
def recording_put(self, payload, stats, timeout=None):
    seen.append((stats.prompt_tokens, admitted[0]))
    return put(self, payload, stats, timeout)
modes.FakeEngine.add, modes.FakeTrainer.put = counting_add, recording_put
modes.run_mode("pipeline")
assert seen and all(counted == want > 0 for counted, want in seen), seen

group = [Sample(0, [1, 2], [3], [-0.5], [0], 1.0)]
_, stats = decode_message(1, 1, *encode_message(group, values(EngineStats(prompt_tokens=12.0, kv_recomputed=1.0)))[1:])
assert (stats.prompt_tokens, stats.kv_recomputed) == (12.0, 1.0), stats

now = total([stats, EngineStats(prompt_tokens=8.0)], EngineStats())
m = step_metrics(group, 0, LossStats(tokens=1.0), now, EngineStats(prompt_tokens=4.0), StepTimes(0.0, 1.0, 2.0, -2.0))
assert m["prompt_tokens_per_s"] == (12 + 8 - 4) / 4, m["prompt_tokens_per_s"]
print("metric ok", pipelinerl_fsdp.__file__)
"""


def test_the_docs_metric_example_counts_sends_and_logs_the_new_number(tmp_path):
    code = blocks(section("Adding a metric"))
    assert [c.split("\n")[0] for c in code] == [
        "# pipelinerl_fsdp/samples.py",
        "# pipelinerl_fsdp/inference/worker.py",
        "# pipelinerl_fsdp/rl/step_metrics.py",
    ]
    root = Path(__file__).resolve().parents[2]
    shutil.copytree(
        root / "pipelinerl_fsdp", tmp_path / "pipelinerl_fsdp", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tmp_path / "train_configs").symlink_to(root / "train_configs")  # the config files sit beside the package
    for c in code:
        apply_insertion(tmp_path, c)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(root / "tests" / "unit" / "inference"), str(root / "tests")]),
    )
    r = subprocess.run(  # in the copy's folder: the interpreter looks there first
        [sys.executable, "-c", METRIC_CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and f"metric ok {tmp_path}" in r.stdout, r.stdout + r.stderr
