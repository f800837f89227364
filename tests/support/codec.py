"""The keys that seal the payloads of this test process's Temporal clients (`adapters/temporal.py`):
the session's server, every harness's settings and every test's own settings share them, so a
worker or API process a test starts reads what the test's client wrote."""

from __future__ import annotations

import base64
import os

CODEC_KEYS = base64.b64encode(os.urandom(32)).decode()
