"""Tasks: prompts, reference solutions, rewards and held-out evaluation splits, one module per task.

Importing this package imports every module in it, so a task registers itself by being a file here.
"""

import importlib
import pkgutil

from pipelinerl_fsdp.tasks.base import (
    TASKS,
    GeneratedTask,
    Problem,
    ProblemStream,
    Task,
    TaskConfig,
    make_task,
    register_task,
    task_class,
)

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != "base":
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = [
    "TASKS",
    "GeneratedTask",
    "Problem",
    "ProblemStream",
    "Task",
    "TaskConfig",
    "make_task",
    "register_task",
    "task_class",
]
