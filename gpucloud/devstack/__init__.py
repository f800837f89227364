"""The embedded stack for one machine: the `up` supervisor, the Temporal dev server, the threaded server."""
