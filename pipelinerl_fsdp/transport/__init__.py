"""Data movement between trainer and inference ranks: weights (broadcast) and rollouts (send/recv)."""
