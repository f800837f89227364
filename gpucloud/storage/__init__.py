"""Per-tenant storage: objects under `tenants/<tenant id>/` on S3 or a local directory, presigned
URLs scoped to one key of a tenant's prefix, envelope encryption with a per-tenant data key, and
deletion after a retention period.

`backends` holds the two object stores behind `ObjectBackend`; `tenant` scopes one to a tenant;
`envelope` wraps tenant data keys under a master key; `retention` marks and purges tenants.
"""
