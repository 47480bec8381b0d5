"""Pure math of training: sequence packing (and, with the RL stage, loss, advantages, ESS)."""
