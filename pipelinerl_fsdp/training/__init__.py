"""The trainer side: the RL trainer and what it is made of (collector, train step, policy, optimizer,
FSDP2 wrapping, checkpoints, metrics, rollout logs, evaluation), and the warm start."""
