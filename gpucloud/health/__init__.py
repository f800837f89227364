"""Node health: pure rules that turn XID events and counter readings into a verdict.

- `verdict`: health, actions, conditions, and the policy's thresholds.
- `xid`: the XID classification table.
- `trends`: counter trends (ECC, remapped rows, NVLink, PCIe, clock slowdowns) from readings.
- `rules`: `evaluate_node`, the whole judgement for one node (bursts, tenants, lemon rule, and
  the signals beyond XIDs through `signals.judge_signals`).
- `breaker`: the circuit breaker that stops automatic quarantine when too much of a pool goes.
- `pulls`: the typed pull decision (replace, drain, none) taken from a verdict.
- `categories`: the Llama 3 interruption categories, shared by the simulator and the signal table.
- `signals`: faults that show no XID (InfiniBand, NIC, PCIe AER, NVRM, hangs, thermal, ...): their
  table and `judge_signals`, into the same conditions as XIDs.
- `signal_sources`: the parsers that turn kernel log lines and InfiniBand sysfs readings into
  signal observations (`read_ib_ports` reads under a root path it is given).
- `correlation`: faults behind one leaf switch, rack or PDU within a window as one fleet
  incident suspecting that component, and which node-level pulls it holds back.
- `spares`: the spares a pool needs (a Poisson count of nodes out, a conservative failure rate).
- `reliability`: MTBF, MTTR and MTTS per GPU type, region and rack, from the nodes' incidents.

No module here reads a clock (callers pass `now`), and none does I/O but `read_ib_ports`.
"""
