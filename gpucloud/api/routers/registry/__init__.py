"""The weight registry API, tenant-scoped, one router per resource: models, signing keys, chunks,
versions, evaluations, aliases and lineage; garbage collection for operators.

A push is: `POST .../chunks:missing` (which of these chunk ids does the store lack?), one
`PUT .../chunks/{id}` per missing chunk (hashed with BLAKE3 on the way in; bytes that do not hash
to the id are refused and leave nothing behind), then `POST .../versions` with the signed manifest.
The manifest is verified against the tenant's registered keys and every chunk it lists must be in
the store before the version row is written, so a listed version is always complete; an
interrupted push resumes by asking again which chunks are missing.

Every query is scoped to the caller's tenant, and a name or id of another tenant gets the same 404
as one that does not exist. Each tenant's chunks live under its own store prefix
(`gpucloud.registry.stores`), so chunk ids are never looked up across tenants either.
"""

from __future__ import annotations

from gpucloud.api.routers.registry import chunks, gc, models, versions

# In the order the API matches them (`web/routes.mount`).
ROUTERS = tuple(module.router for module in (models, chunks, versions, gc))
