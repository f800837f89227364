"""The fleet reconciler: level-triggered convergence of every node (see plan.py, sweep.py)."""
