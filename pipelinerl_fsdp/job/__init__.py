"""The job around the roles: the torchrun world and its groups, launch questions, the plan, stopping,
fault injection, CPU binding, the process tree, GPU counts, host memory."""
