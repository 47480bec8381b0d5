"""Tools that environments let the model call, run where they cannot hurt the run (sandbox.py)."""
