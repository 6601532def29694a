"""Training: one driver (driver.py) over named objectives (objectives.py), the loop with checkpoints and exact resume
(loop.py), the causal LM objective (lm.py)."""
