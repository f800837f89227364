"""The CLI's output and exit codes, against a canned API: tables keep ids and digests whole at 80
columns, `-o json` prints one document, an API's 400 or 422 exits 2 as bad usage does, the new
`weights gates` and `usage` commands, and a tenant's keys live in the per-user config folder,
never in the directory the CLI runs from.

Before: at 80 columns `allocations list` printed `alloc_…` and `weights versions` 12 hex digits;
`weights versions -o json` was refused; a 422 exited 1; a pull's keys were read from and written
to `./.data` of the current directory."""

from __future__ import annotations

import io
import json
import re
import stat
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import typer
from nacl.signing import SigningKey
from typer.testing import CliRunner

from gpucloud.cli import common, tenant_keys
from gpucloud.cli import weights as weights_cli
from gpucloud.cli.main import app
from gpucloud.client.base import ApiClient
from gpucloud.registry.manifest import UnknownKeyError, key_id_of

pytestmark = pytest.mark.unit

TENANT = "ten_0123456789abcdef0123"
ALLOCATION = "alloc_a1b2c3d4e5f6a7b8c9d0"
DIGEST = "3f2a9c1d" * 8
PARENT = "9e8d7c6b" * 8
PUBLIC_KEY = bytes(SigningKey(b"k" * 32).verify_key).hex()

Handler = Callable[[httpx.Request], httpx.Response]


def _allocation() -> dict:
    return {
        "id": ALLOCATION,
        "tenant_id": TENANT,
        "status": "provisioning",
        "desired": "running",
        "gpu_type": "H100",
        "node_count": 4,
        "region": "us-east-1",
        "fabric_domain": "ib-pod-a-rack-3",
        "nvlink_domain": None,
        "node_ids": [],
        "failure_reason": None,
        "created_at": "2026-12-06T10:20:18Z",
        "updated_at": "2026-12-06T10:20:18Z",
    }


def _version() -> dict:
    return {
        "digest": DIGEST,
        "created_at": "2026-12-06T10:20:18Z",
        "total_size": 12_300_000_000,
        "parent": PARENT,
        "aliases": ["production"],
        "metrics": {"nan_inf_count": 0},
        "reported_metrics": {},
    }


GATES = [
    {"metric": "accuracy", "evaluator": "command", "min": 0.7, "max": None, "max_regression": 0.02},
    {"metric": "nan_inf_count", "evaluator": "sanity", "min": None, "max": 0, "higher_is_better": False},
]
USAGE = {
    "tenant_id": TENANT,
    "allocation_id": None,
    "start_ms": None,
    "end_ms": None,
    "sample_count": 120,
    "gpu_ms": 7_200_000,
    "amount_micro": 5_000_000,
    "reversed_gpu_ms": 0,
    "reversed_amount_micro": 0,
    "net_gpu_ms": 7_200_000,
    "net_amount_micro": 5_000_000,
    "by_gpu_type": [
        {
            "gpu_type": "H100",
            "sample_count": 120,
            "gpu_ms": 7_200_000,
            "amount_micro": 5_000_000,
            "reversed_gpu_ms": 0,
            "reversed_amount_micro": 0,
        }
    ],
}


def _routes() -> dict[tuple[str, str], Handler]:
    def answer(body: object, status: int = 200) -> Handler:
        return lambda request: httpx.Response(status, json=body)

    def usage(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={**USAGE, "period": request.url.params.get("period")})

    def set_gates(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"name": "llama", "gates": json.loads(request.content)["gates"]})

    return {
        ("GET", "/v1/allocations"): answer({"items": [_allocation()], "next_page_token": ""}),
        ("GET", "/v1/models/llama/versions"): answer({"items": [_version()], "next_page_token": ""}),
        ("GET", "/v1/signing-keys"): answer(
            {"tenant_id": TENANT, "items": [{"key_id": key_id_of(bytes.fromhex(PUBLIC_KEY)), "public_key": PUBLIC_KEY}]}
        ),
        ("GET", "/v1/models/llama"): answer({"name": "llama", "gates": GATES}),
        ("PUT", "/v1/models/llama/gates"): set_gates,
        ("GET", "/v1/usage"): usage,
    }


@pytest.fixture
def api(tmp_path, monkeypatch) -> dict[tuple[str, str], Handler]:
    """A canned API every client of the CLI calls (its routes, to change), an 80-column terminal,
    and an empty working directory."""
    routes = _routes()

    def handle(request: httpx.Request) -> httpx.Response:
        route = routes.get((request.method, request.url.path))
        return route(request) if route else httpx.Response(404, json={"title": "Not found", "detail": "no route"})

    original = ApiClient.__init__

    def init(self, base_url: str, token: str, **options) -> None:
        original(self, base_url, token, **{**options, "transport": httpx.MockTransport(handle)})

    monkeypatch.setattr(ApiClient, "__init__", init)
    monkeypatch.setattr(common.console, "width", 80)
    monkeypatch.setenv("GPUCLOUD_API_URL", "http://api.test")
    monkeypatch.setenv("GPUCLOUD_API_KEY", "gpc_test")
    monkeypatch.delenv("GPUCLOUD_DATA_DIR", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return routes


def run(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, result.output
    return result.output


def test_tables_keep_ids_and_digests_whole_at_80_columns(api) -> None:
    listed = run("allocations", "list")
    assert ALLOCATION in listed and "…" not in listed
    assert all(len(line) <= 80 for line in listed.splitlines()), listed  # the default view fits
    wide = run("allocations", "list", "-o", "wide")
    assert ALLOCATION in wide and TENANT in wide and "ib-pod-a-rack-3" in wide and "…" not in wide

    versions = run("weights", "versions", "llama")
    assert DIGEST in versions and "…" not in versions and "production" in versions
    assert PARENT in run("weights", "versions", "llama", "-o", "wide")
    assert PUBLIC_KEY in run("weights", "keys")
    keys = run("weights", "keys", "-o", "wide")
    assert PUBLIC_KEY in keys and key_id_of(bytes.fromhex(PUBLIC_KEY)) in keys


def test_print_table_shares_out_the_room_without_cutting_a_word() -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(width=60, record=True, file=io.StringIO())
    table = Table(common.id_column("id"), "status", "note")
    table.add_row(ALLOCATION, "provisioning", "a long note that has to wrap over several lines here")
    common.print_table(table, out=out)
    text = out.export_text()
    assert ALLOCATION in text and "provisioning" in text and "…" not in text
    assert all(len(line) <= 60 for line in text.splitlines())


def test_data_commands_print_json(api) -> None:
    assert json.loads(run("allocations", "list", "-o", "json"))[0]["id"] == ALLOCATION
    assert json.loads(run("weights", "versions", "llama", "-o", "json"))[0]["digest"] == DIGEST
    [key] = json.loads(run("weights", "keys", "-o", "json"))
    assert key["public_key"] == PUBLIC_KEY and key["trusted_here"] is False
    assert json.loads(run("weights", "gates", "llama", "-o", "json")) == {"model": "llama", "gates": GATES}
    assert json.loads(run("usage", "-o", "json"))["net_gpu_ms"] == 7_200_000
    run("allocations", "list", "-o", "yaml", code=2)


def test_weights_gates_shows_and_replaces_a_models_gates(api, tmp_path) -> None:
    shown = run("weights", "gates", "llama")
    assert "accuracy" in shown and "command" in shown and "0.7" in shown and "0.02" in shown
    assert "nan_inf_count" in shown and "lower" in shown
    assert "production takes only a version a platform sanity evaluation passed" in re.sub(r"\s+", " ", shown)
    gates = tmp_path / "gates.yaml"
    gates.write_text("- metric: accuracy\n  min: 0.8\n")
    replaced = json.loads(run("weights", "gates", "llama", "--set", str(gates), "-o", "json"))
    assert replaced["gates"] == [{"metric": "accuracy", "min": 0.8}]
    gates.write_text("metric: accuracy\n")
    assert "no list of gates" in run("weights", "gates", "llama", "--set", str(gates), code=2)


def test_usage_shows_this_periods_metered_usage(api) -> None:
    period = datetime.now(UTC).strftime("%Y-%m")
    shown = run("usage")
    assert f"period {period}" in re.sub(r"\s+", " ", shown)
    assert "H100" in shown and "2.0000" in shown and "5.000000" in shown  # 2 GPU-hours, 5 units
    assert json.loads(run("usage", "--period", "2026-01", "-o", "json"))["period"] == "2026-01"


@pytest.mark.parametrize(
    ("status", "code"),
    [(400, 2), (422, 2), (401, 1), (403, 1), (404, 3), (409, 4), (500, 1), (503, 5)],
)
def test_api_refusals_exit_with_the_readmes_codes(status, code) -> None:
    assert common.exit_code_for(status) == code


@pytest.mark.parametrize("status", [400, 422])
def test_a_request_the_api_calls_invalid_is_a_usage_error(api, status) -> None:
    problem = {"title": "Invalid request", "detail": "status: not one of provisioning, ready"}
    api[("GET", "/v1/allocations")] = lambda request: httpx.Response(status, json=problem)
    refused = run("allocations", "list", "--status", "sideways", code=2)
    assert f"error ({status})" in refused and "not one of" in refused


def test_keys_live_in_the_per_user_config_folder_never_in_the_working_directory(api, cli_config) -> None:
    folder = cli_config.parent
    trusted = run("weights", "trust", PUBLIC_KEY, "--label", "ci")
    assert str(folder) in re.sub(r"\s+", "", trusted)
    ring = folder / "trusted-keys" / TENANT
    assert ring.read_text() == f"{PUBLIC_KEY} ci\n"
    assert json.loads(run("weights", "keys", "-o", "json"))[0]["trusted_here"] is True

    signer = tenant_keys.signer(TENANT)  # as a push or a reported evaluation makes it
    key = folder / "signing-keys" / f"{TENANT}.ed25519"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert tenant_keys.signer(TENANT).key_id == signer.key_id
    assert bytes(signer.verify_key) in [bytes(k) for k in tenant_keys.trusted(TENANT)]
    assert not Path(".data").exists() and list(Path().iterdir()) == []


def test_keys_left_in_the_old_data_dir_are_used_with_the_command_that_moves_them(api, cli_config, capsys) -> None:
    old = Path(".data") / "signing-keys" / f"{TENANT}.ed25519"
    old.parent.mkdir(parents=True)
    old.write_text(SigningKey(b"o" * 32).encode().hex() + "\n")
    ring = Path(".data") / "trusted-keys" / TENANT
    ring.parent.mkdir(parents=True)
    ring.write_text(f"{PUBLIC_KEY} old\n")

    signer = tenant_keys.signer(TENANT)
    assert bytes(signer.verify_key) == bytes(SigningKey(b"o" * 32).verify_key)
    said = re.sub(r"\s+", " ", capsys.readouterr().err)
    assert f"mkdir -p -m 700 {cli_config.parent / 'signing-keys'} && mv {old.absolute()}" in said
    assert not (cli_config.parent / "signing-keys").exists()  # nothing made in the new place yet

    listed = CliRunner().invoke(app, ["weights", "keys", "-o", "json"])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout)[0]["trusted_here"] is True
    assert f"{cli_config.parent / 'trusted-keys'} && mv {ring.absolute()}" in re.sub(r"\s+", " ", listed.stderr)

    # A key trusted in the new place takes nothing away from those not moved yet.
    newer = bytes(SigningKey(b"n" * 32).verify_key)
    tenant_keys.trust(TENANT, newer.hex())
    capsys.readouterr()
    assert {bytes(k) for k in tenant_keys.trusted(TENANT)} >= {newer, bytes.fromhex(PUBLIC_KEY)}
    said = re.sub(r"\s+", " ", capsys.readouterr().err)
    assert f"cat {ring.absolute()} >> {cli_config.parent / 'trusted-keys' / TENANT}" in said
    assert ring.read_text() == f"{PUBLIC_KEY} old\n"  # the old place only read


def test_a_pull_refused_for_an_untrusted_key_says_how_to_trust_it(capsys) -> None:
    with pytest.raises(typer.Exit) as exited, weights_cli._reported_errors():
        raise UnknownKeyError(f"key k1 is not trusted by tenant {TENANT!r}")
    assert exited.value.exit_code == 2
    said = re.sub(r"\s+", " ", capsys.readouterr().err)
    assert "gpucloud weights trust PUBLIC_KEY" in said and "gpucloud weights keys" in said
    assert "nothing was written" in said
