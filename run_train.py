"""torchrun entry: `torchrun --nproc-per-node N run_train.py --config train_configs/arithmetic.toml`."""

import sys

from pipelinerl_fsdp.train import main

if __name__ == "__main__":
    sys.exit(main())
