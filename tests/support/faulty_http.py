"""A reverse proxy that misbehaves on purpose, for outside systems that cannot misbehave on their
own (the Redfish emulator always answers, and always applies a reset it accepted).

Modes, switched while it runs (`proxy.mode = ...`):
- `pass`: forward everything;
- `error_500`: answer every request 500 with a Redfish-style error body;
- `hang`: accept the request and answer nothing for `hang_s` (past the client's timeout);
- `swallow_resets`: forward everything but POSTs to a `Reset` action, which it answers 204
  without forwarding (a BMC that accepts a reset and never changes power state);
- `garbage`: answer 200 with a body that is not JSON;
- `accept_updates`: forward everything but POSTs to the UpdateService's SimpleUpdate, which it
  answers 202 with a task monitor (a BMC whose firmware update starts);
- `real_hardware`: forward everything, adding to every ComputerSystem what a real server's BMC
  reports and the emulator's fake systems do not (`hardware`: serial number, model, CPU count,
  memory, BIOS version);
- `no_virtual_media`: forward everything, removing the VirtualMedia link from every
  ComputerSystem (a BMC without virtual media).

Every request is kept (`requests`: method and path; `bodies`: method, path and body).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer

import httpx


class FileServer:
    """Files of a directory over loopback HTTP: the images a BMC's virtual media fetches."""

    def __init__(self, directory: str) -> None:
        class Quiet(SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

        handler = functools.partial(Quiet, directory=directory)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def __enter__(self) -> FileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class FaultyProxy:
    def __init__(self, upstream: str, *, hang_s: float = 30.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.mode = "pass"
        self.hang_s = hang_s
        self.hardware = {
            "SerialNumber": "SN-7Z23A01B",
            "Model": "ThinkSystem SR675 V3 (HGX H100 8-GPU)",
            "ProcessorSummary": {"Count": 2, "Model": "AMD EPYC 9454"},
            "MemorySummary": {"TotalSystemMemoryGiB": 2048},
            "BiosVersion": "KAE120H-2.10",
        }
        self.requests: list[tuple[str, str]] = []
        self.bodies: list[tuple[str, str, bytes]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.requests.append((self.command, self.path))
                proxy.bodies.append((self.command, self.path, body))
                mode = proxy.mode
                if mode == "hang":
                    time.sleep(proxy.hang_s)
                    return
                if mode == "error_500":
                    return self._answer(500, b'{"error": {"message": "internal BMC error"}}', "application/json")
                if mode == "garbage":
                    return self._answer(200, b"<html>BMC firmware update in progress</html>", "text/html")
                if mode == "swallow_resets" and self.command == "POST" and "Reset" in self.path:
                    return self._answer(204, b"", "application/json")
                if mode == "accept_updates" and self.command == "POST" and "SimpleUpdate" in self.path:
                    self.send_response(202)
                    self.send_header("Location", "/redfish/v1/TaskService/Tasks/1")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                answer = httpx.request(
                    self.command, proxy.upstream + self.path, content=body, headers=headers, timeout=30
                )
                content = answer.content
                if (
                    mode in ("real_hardware", "no_virtual_media")
                    and self.command == "GET"
                    and answer.status_code == 200
                ):
                    document = json.loads(content)
                    if str(document.get("@odata.type", "")).startswith("#ComputerSystem.v"):
                        if mode == "real_hardware":
                            document.update(proxy.hardware)
                        else:
                            document.pop("VirtualMedia", None)
                        content = json.dumps(document).encode()
                self._answer(answer.status_code, content, answer.headers.get("content-type", ""))

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                if content_type:
                    self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FaultyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
