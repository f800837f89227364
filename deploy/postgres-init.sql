-- The ledger keeps its own database beside the control plane's (and Temporal its own two,
-- which temporalio/auto-setup creates).
CREATE DATABASE gpucloud_ledger OWNER gpucloud;
