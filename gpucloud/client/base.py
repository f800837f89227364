"""What every call to the public API shares: the bearer token, problem+json errors as `ApiError`,
retries of what may be retried, keyset pagination, and bounded waits for a state.

Retried: a connection that failed or timed out, and 429 / 503 answers (after their
`Retry-After`), for reads always and for writes only under an `Idempotency-Key` (a replay then
returns the first answer, so a retry can never create twice) or where the write is idempotent by
itself (a chunk upload: its id is its content). Anything else is raised at once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx

from gpucloud.retry import Backoff, parse_retry_after, retry_call
from gpucloud.web import buffers, tls
from gpucloud.web.http_client import http_client

T = TypeVar("T")

RETRYABLE_STATUS = frozenset({429, 502, 503, 504})


class ApiError(Exception):
    """The API answered with an error; `type` is the problem type's last segment (e.g. `quota-exceeded`)."""

    def __init__(self, status: int, body: dict[str, Any], *, retry_after_s: float | None = None) -> None:
        self.status, self.body, self.retry_after_s = status, body, retry_after_s
        self.type = str(body.get("type", "")).rsplit("/", 1)[-1]
        self.title = str(body.get("title", "HTTP error"))
        self.detail = str(body.get("detail", ""))
        super().__init__(f"{self.title} ({status}): {self.detail}")

    @classmethod
    def from_response(cls, response: httpx.Response) -> ApiError:
        return cls.from_parts(response.status_code, response.content, response.headers.get("retry-after", ""))

    @classmethod
    def from_parts(cls, status: int, content: bytes, retry_after: str) -> ApiError:
        """The error that an answer of `status` with body `content` (problem+json, or anything a
        proxy on the way sent) and a `Retry-After` header (or "") stands for."""
        try:
            body = json.loads(content)
        except ValueError:
            body = {"detail": content[:500].decode("utf-8", "replace")}
        return cls(
            status,
            body if isinstance(body, dict) else {"detail": str(body)},
            retry_after_s=parse_retry_after(retry_after),
        )


class ApiTimeout(TimeoutError):
    """A wait for a state ran out (`ApiClient.wait_for`)."""


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, ApiError):
        return exc.status in RETRYABLE_STATUS
    return isinstance(exc, httpx.TransportError)


def _retry_after_s(exc: BaseException) -> float | None:
    return exc.retry_after_s if isinstance(exc, ApiError) else None


# Between retries: a quarter second, doubling to 5 s; a server's Retry-After, up to 30 s.
BACKOFF = Backoff(first_s=0.25, cap_s=5.0)
RETRY_AFTER_CAP_S = 30.0


class ApiClient:
    """One caller of the API (a tenant's key, the operator token or a node's agent credential)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        retry_for_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry_for_s = retry_for_s
        buffers.raise_client_read_size()
        self.http = http_client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout="api",
            timeout_s=timeout_s,
            transport=transport,
            trust=tls.client_verify(),
        )

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def request(
        self, method: str, path: str, *, idempotency_key: str | None = None, retry: bool | None = None, **kwargs: Any
    ) -> httpx.Response:
        """The response to a call, or `ApiError`. `retry` defaults to: reads, and writes under an
        `idempotency_key`; a streamed body (`content=` an iterator) is never retried."""
        if idempotency_key is not None:
            kwargs["headers"] = {**kwargs.get("headers", {}), "Idempotency-Key": idempotency_key}
        if retry is None:
            retry = method.upper() in ("GET", "HEAD") or idempotency_key is not None

        def once() -> httpx.Response:
            response = self.http.request(method, path, **kwargs)
            if response.status_code >= 400:
                raise ApiError.from_response(response)
            return response

        if not retry:
            return once()
        return self.retried(once)

    def retried(self, call: Callable[[], T], *, broken: tuple[type[BaseException], ...] = ()) -> T:
        """`call()`, made again while it fails with a retryable answer (429, 502-504, after its
        `Retry-After`), a failed httpx transport or one of `broken`, for up to `retry_for_s`."""

        def retryable(exc: BaseException) -> bool:
            return _retryable(exc) or isinstance(exc, broken)

        return retry_call(
            call,
            retry_on=retryable,
            backoff=BACKOFF,
            attempts=None,
            deadline_s=self.retry_for_s,
            retry_after=_retry_after_s,
            retry_after_cap_s=RETRY_AFTER_CAP_S,
        )

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """The decoded JSON body of a call (None for an empty one)."""
        response = self.request(method, path, **kwargs)
        return response.json() if response.content else None

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.call("GET", path, **kwargs)

    def stream_text(self, path: str, *, params: dict[str, Any] | None = None) -> Iterator[str]:
        """A GET's text body piece by piece as it arrives (a followed log), without a read
        timeout: the server bounds how long it streams. An error answer is `ApiError`."""
        timeout = httpx.Timeout(None, connect=10.0)
        with self.http.stream("GET", path, params=params, timeout=timeout) as response:
            if response.status_code >= 400:
                response.read()
                raise ApiError.from_response(response)
            yield from response.iter_text()

    def create(self, path: str, body: dict[str, Any], *, idempotency_key: str | None = None) -> Any:
        """A create under an Idempotency-Key (a fresh one unless given), so it is safe to retry."""
        return self.call("POST", path, json=body, idempotency_key=idempotency_key or str(uuid.uuid4()))

    def pages(self, path: str, *, page_size: int = 1000, **params: Any) -> Iterator[dict[str, Any]]:
        """Every item of a keyset-paginated listing, page after page."""
        query = {k: v for k, v in params.items() if v is not None} | {"page_size": page_size}
        while True:
            page = self.get(path, params=query)
            yield from page["items"]
            if not page.get("next_page_token"):
                return
            query["page_token"] = page["next_page_token"]

    def wait_for(
        self,
        fetch: Callable[[], T],
        done: Callable[[T], bool],
        *,
        timeout_s: float,
        interval_s: float = 0.5,
        what: str = "the state",
        on_poll: Callable[[T], None] | None = None,
    ) -> T:
        """Poll `fetch` until `done` holds for its answer; `ApiTimeout` naming `what` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = fetch()
            if on_poll is not None:
                on_poll(value)
            if done(value):
                return value
            if time.monotonic() >= deadline:
                raise ApiTimeout(f"{what} not reached within {timeout_s:g} s (last: {value!r:.300})")
            time.sleep(interval_s)
