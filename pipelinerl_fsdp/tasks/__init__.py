"""Tasks: prompts, reference solutions, rewards and held-out evaluation splits."""

from pipelinerl_fsdp.tasks.arithmetic import TASKS, Problem, Task, make_task

__all__ = ["TASKS", "Problem", "Task", "make_task"]
