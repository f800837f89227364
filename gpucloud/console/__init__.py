"""The web console at `/console`: server-rendered pages for operators (the fleet map, a node's
page) and tenants (their allocations), signed in with the same credentials as the API and served
behind the same gate and admission (`docs/console.md`). Its routes: `console/routes.py`."""
