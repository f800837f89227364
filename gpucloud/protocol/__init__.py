"""The node protocol: what the control plane and a node's agent (the real one, `agent/`, or a
simulated node, `sim/`) say to each other, owned by neither. `actions`: `AgentAction`, the
`ActionRequest` the control plane sends to `POST /actions/{action}` and the `ActionAnswer` it
gets back. `reports`: what an agent sends on its own (heartbeats, readings, XID events) and the
batches the API accepts them in. `reporter`: `ReportClient`, the one way they are sent."""
