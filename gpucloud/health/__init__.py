"""Node health: pure rules that turn XID events and counter readings into a verdict.

- `verdict`: health, actions, conditions, and the policy's thresholds.
- `xid`: the XID classification table.
- `trends`: counter trends (ECC, remapped rows, NVLink, PCIe, clock slowdowns) from readings.
- `rules`: `evaluate_node`, the whole judgement for one node (bursts, tenants, lemon rule).
- `breaker`: the circuit breaker that stops automatic quarantine when too much of a pool goes.

No module here does I/O or reads a clock: callers pass `now`.
"""
