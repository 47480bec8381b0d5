"""The warm-start folder's record of the held-out problems its training never drew, and the check on reuse."""

from __future__ import annotations

import json

from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.tasks import Task, make_task
from pipelinerl_fsdp.training.warmstart import HELD_OUT_FILE, held_out_fingerprints, held_out_problem


def _task(*overrides: str) -> Task:
    return make_task(load_config(["--config", "arithmetic", *overrides]).task)


def test_reuse_is_checked_against_the_held_out_problems_the_warm_start_kept_out(tmp_path):
    task = _task("--task.eval_size=16")
    (tmp_path / HELD_OUT_FILE).write_text(json.dumps({"prompt_sha256_16": held_out_fingerprints(task)}))
    assert len(held_out_fingerprints(task)) == 16
    assert held_out_problem(tmp_path, task) is None
    # a smaller held-out set is the start of the same draw: every problem of it was kept out
    small_task = _task("--task.eval_size=8")
    assert held_out_problem(tmp_path, small_task) is None
    # a larger one: its last 16 problems may have been trained on
    big_task = _task("--task.eval_size=32")
    why = held_out_problem(tmp_path, big_task)
    assert why is not None and "16 of this run's 32 held-out problems" in why
    assert "task.eval_size=32" in why and str(tmp_path) in why
    # another evaluation seed draws other problems
    seed_task = _task("--task.eval_size=16", "--task.eval_seed=7")
    why = held_out_problem(tmp_path, seed_task)
    assert why is not None and "task.eval_seed=7" in why


def test_a_folder_without_the_record_cannot_be_checked_and_is_accepted(tmp_path):
    task = _task("--task.eval_size=16")
    assert held_out_problem(tmp_path, task) is None
