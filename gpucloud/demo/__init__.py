"""`gpucloud demo`: a private stack, then a tenant's day through the public API; one module per part."""
