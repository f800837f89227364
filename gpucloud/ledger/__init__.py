"""The usage ledger: its own service and database, fed at-least-once by the nodes' spools.

It records each usage sample exactly once per (node_id, seq), rates it from a versioned
price book in integer micro-units, books it as append-only double-entry postings, reconciles
metered usage against allocation events, and closes billing periods into invoices that are
reproducible byte for byte. ``service.py`` is the process; ``pricing.py`` and ``close.py``
are the pure logic; the rest are the database and HTTP layers. See ``docs/ledger.md``.
"""
