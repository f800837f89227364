"""Issue 42: `gpucloud fleet spares` prints the spares per pool as a table (a shortfall shown),
or the API's document with `--json` / `-o json`, against a canned API with an operator's token."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from typer.testing import CliRunner

from gpucloud.cli import common
from gpucloud.cli.main import app
from gpucloud.client.base import ApiClient

pytestmark = pytest.mark.unit


def _pool(pool: str, *, held: int, needed: int, source: str, rate: float) -> dict:
    gpu_type, region = pool.split("/")
    return {
        "pool": pool,
        "gpu_type": gpu_type,
        "region": region,
        "nodes": 1000,
        "spares_held": held,
        "spares_needed": needed,
        "shortfall": max(needed - held, 0),
        "failures": 12,
        "node_hours": 720_000.0,
        "measured_per_node_hour": 1.67e-5,
        "failures_per_node_hour": rate,
        "rate_source": source,
        "repair_hours": 72.0,
        "replacement_target_hours": 0.0,
        "probability": 0.99,
        "expected_out": 11.4,
        "coverage_held": 0.42,
        "spare_on_failure": 0.3,
    }


SPARES = {
    "at": "2026-12-06T12:00:00Z",
    "window_s": 30 * 86_400.0,
    "pools": [
        _pool("H100/us-east-1", held=10, needed=20, source="llama3_default", rate=1.5786e-4),
        _pool("A100/eu-west-1", held=5, needed=3, source="measured", rate=2.73e-5),
    ],
}


@pytest.fixture
def seen(monkeypatch) -> list[httpx.Request]:
    requests: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        if (request.method, request.url.path) == ("GET", "/v1/fleet/spares"):
            return httpx.Response(200, json=SPARES)
        return httpx.Response(404, json={"title": "Not found", "detail": "no route"})

    original = ApiClient.__init__

    def init(self, base_url: str, token: str, **options) -> None:
        original(self, base_url, token, **{**options, "transport": httpx.MockTransport(handle)})

    monkeypatch.setattr(ApiClient, "__init__", init)
    monkeypatch.setattr(common.console, "width", 80)
    monkeypatch.setenv("GPUCLOUD_API_URL", "http://api.test")
    monkeypatch.setenv("GPUCLOUD_API__OPERATOR_TOKEN", "operator-token")
    return requests


def _run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _cells(out: str, first: str) -> list[str]:
    [line] = [line for line in out.splitlines() if line.startswith(first)]
    return re.split(r"\s{2,}", line.strip())


def test_the_table_shows_each_pool_with_its_shortfall(seen, monkeypatch) -> None:
    monkeypatch.setattr(common.console, "width", 200)
    out = _run("fleet", "spares")
    assert seen[0].headers["authorization"] == "Bearer operator-token"
    assert _cells(out, "pool") == ["pool", "nodes", "held", "needed", "shortfall", "rate", "rate source", "probability"]
    assert "failures per node-hour, over 30 days" in out
    assert _cells(out, "H100/us-east-1") == [
        "H100/us-east-1",
        "1000",
        "10",
        "20",
        "10",
        "0.000158",
        "llama3 default",
        "0.99",
    ]
    assert _cells(out, "A100/eu-west-1") == ["A100/eu-west-1", "1000", "5", "3", "0", "2.73e-05", "measured", "0.99"]


def test_the_table_fits_80_columns(seen) -> None:
    out = _run("fleet", "spares")
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert "H100/us-east-1" in out and "0.000158" in out and "llama3" in out and "probability" in out


@pytest.mark.parametrize("flags", [["--json"], ["-o", "json"], ["--output", "json"]])
def test_json_prints_the_apis_document(seen, flags: list[str]) -> None:
    body = json.loads(_run("fleet", "spares", *flags))
    assert body["window_s"] == SPARES["window_s"]
    assert [p["pool"] for p in body["pools"]] == ["H100/us-east-1", "A100/eu-west-1"]
    assert body["pools"][0]["shortfall"] == 10 and body["pools"][1]["rate_source"] == "measured"
