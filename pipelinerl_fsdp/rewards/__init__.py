"""Rewards: outcome kinds, the math answer checker (math-verify), and the scorers that run reward functions off
the engine's decode loop (a pool of worker processes with per-answer timeouts)."""
