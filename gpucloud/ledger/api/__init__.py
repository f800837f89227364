"""HTTP routers of the ledger service, one per resource."""
