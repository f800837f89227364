"""Tenant isolation on the fabrics: InfiniBand partitions, NVLink partitions and Ethernet VPCs.

`interface` names what a fabric manager can do, `http_clients` reaches the managers over HTTP,
`membership` applies, verifies and releases an allocation's membership, and `isolation` checks a
snapshot of the managers' state for paths between tenants.
"""
