"""Low-level runtime pieces every role uses, below the job and the roles: stopping on signals, fault injection,
the process tree, host memory, GPU counts, CPU binding. They import nothing of the package."""
