"""An ASGI app served by uvicorn on a daemon thread with its own event loop.

Used where a process hosts HTTP services beside its own work: peers and the tracker in fan-out
runs, the simulated fabric managers, and the API in tests. `start` returns the base URL
(port 0 picks a free port).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from gpucloud.web.tls import ServerTLS, scheme, serve_options


class ThreadedServer:
    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "asgi",
        tls: ServerTLS | None = None,
        **uvicorn_options: Any,
    ) -> None:
        secure = serve_options(host, tls, what=name)
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, **secure, **uvicorn_options
        )
        self._scheme = scheme(tls)
        self._server = uvicorn.Server(config)
        self._host = host
        self._name = name
        self._thread = threading.Thread(target=self._server.run, name=f"{name}-{host}:{port}", daemon=True)
        self.url = ""

    def start(self, *, timeout_s: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self._name} server on {self._host} did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"{self._scheme}://{self._host}:{port}"
        return self.url

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
