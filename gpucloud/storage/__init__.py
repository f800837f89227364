"""Object storage: the one object store (`objects`: a local directory in `local`, an S3 bucket in
`s3`) under registry chunks, manifests and tenant storage; and tenant storage on it: objects
under `tenants/<tenant id>/`, presigned URLs scoped to one key of a tenant's prefix (`tenant`),
envelope encryption with a per-tenant data key (`envelope`), deletion after a retention period
(`retention`).
"""
