"""Tasks: prompts, reference solutions, rewards and held-out evaluation splits, one module per task.

Importing this package imports every module in it, so a task registers itself by being a file here.
"""

import importlib
import pkgutil

from pipelinerl_fsdp.tasks.base import (
    TASKS,
    EnvironmentConfig,
    GeneratedTask,
    Problem,
    ProblemStream,
    Task,
    TaskConfig,
    register_task,
)

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != "base":
        importlib.import_module(f"{__name__}.{_mod.name}")


def task_class(name: str) -> type[Task]:
    """The registered task class named `name`."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def make_task(cfg: TaskConfig) -> Task:
    """The task named by `cfg.name`, built from its config (a task from files reads and checks them here: the
    job builds it once per rank, `job_inputs.build_job_inputs`)."""
    cls = task_class(cfg.name)
    if not isinstance(cfg, cls.config_class):
        raise TypeError(f"task {cfg.name!r} needs a {cls.config_class.__name__}, got {type(cfg).__name__}")
    return cls(cfg)


__all__ = [
    "TASKS",
    "EnvironmentConfig",
    "GeneratedTask",
    "Problem",
    "ProblemStream",
    "Task",
    "TaskConfig",
    "make_task",
    "register_task",
    "task_class",
]
