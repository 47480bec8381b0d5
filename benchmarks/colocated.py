"""The colocated baseline: the job's `rl.mode = "colocated"` (pipelinerl_fsdp/training/colocated.py), one process
that generates with every core, then trains with every core, and again. This script runs it with the job's
arguments, the same as `python run_train.py ARGS --rl.mode=colocated`:

    python -m benchmarks.colocated --config arithmetic.toml --warmstart.path=outputs/warmstart/addition-debug \
        --rl.max_steps=50 --job.output_dir=outputs/colocated
"""

from __future__ import annotations

import sys

from pipelinerl_fsdp.train import main

if __name__ == "__main__":
    sys.exit(main([*sys.argv[1:], "--rl.mode=colocated"]))
