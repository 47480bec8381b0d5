"""What the launch scripts need from the config before torchrun starts (the config and the task's data files
checked on the way, so that a bad key or file fails here, in one process, with its name):

    python -m pipelinerl_fsdp.launch max-restarts [--config NAME] [--section.key=value ...]
"""

from __future__ import annotations

import sys

from pipelinerl_fsdp.config import ConfigError
from pipelinerl_fsdp.configure import load_config, named_source
from pipelinerl_fsdp.tasks import task_class

QUERIES = {"max-restarts": lambda cfg: cfg.job.max_restarts}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in QUERIES:
        print(f"usage: python -m pipelinerl_fsdp.launch {{{','.join(QUERIES)}}} [config arguments]", file=sys.stderr)
        return 2
    try:
        cfg = load_config(argv[1:])
        if cfg.job.stage != "plan":  # the task's data files too (a plan reads none): a bad one is named here
            with named_source(cfg.source):
                task_class(cfg.task.name).check_files(cfg.task)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(QUERIES[argv[0]](cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
