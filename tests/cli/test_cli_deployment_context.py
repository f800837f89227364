"""A context of the CLI's config file against a live API over TLS with a private CA: the
context's CA is what lets the CLI in, its token file is what it sends, and a refused token or an
unreachable URL is named by where it came from. The environment overrides the context."""

from __future__ import annotations

import json
import os
import re

import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import app
from gpucloud.config import Settings
from gpucloud.devstack.stack import free_port
from gpucloud.web.serving import ThreadedServer
from gpucloud.web.tls import LocalCA

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

OPERATOR_TOKEN = "gpcop_context-test-operator"


def test_a_context_reaches_the_api_and_refusals_name_the_context_and_file(tmp_path, temporal_env, monkeypatch):
    from gpucloud.api.app import create_app

    settings = Settings(
        data_dir=tmp_path / "server",
        temporal={"address": temporal_env.client.service_client.config.target_host, "task_queue": "tq-contexts"},
        api={"port": free_port(), "operator_token": OPERATOR_TOKEN},
    )
    ca = LocalCA(tmp_path / "ca")
    good, stale = tmp_path / "operator_token", tmp_path / "stale_token"
    for path, token in ((good, OPERATOR_TOKEN), (stale, "gpcop_revoked-long-ago")):
        path.write_text(token + "\n")
        path.chmod(0o600)
    for name in [k for k in os.environ if k.startswith("GPUCLOUD_") and k != "GPUCLOUD_CONFIG"]:
        monkeypatch.delenv(name)  # a shell that says nothing but where the config file is
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def run(*args: str, code: int = 0, **env: str) -> str:
        result = CliRunner().invoke(app, list(args), env=env)
        assert result.exit_code == code, result.output
        return re.sub(r"\s+", " ", result.output)

    server = ThreadedServer(
        create_app(settings), port=settings.api.port, name="api", tls=ca.issue("api", ["127.0.0.1"])
    )
    with server:
        url = server.url
        run("config", "set-context", "prod", "--api-url", url, "--token-file", str(good), "--use")
        # The API's certificate is signed by a CA nobody here trusts yet: the error says how to give it.
        said = run("nodes", code=5)
        assert f"cannot reach the API at {url} (the URL from context 'prod')" in said
        assert "--ca-file" in said and "CERTIFICATE_VERIFY_FAILED" in said

        run("config", "set-context", "prod", "--ca-file", str(ca.cert_file))
        listed = json.loads(run("nodes", "-o", "json"))
        assert listed["nodes"] == [] and listed["summary"]["total"] == 0

        run(
            "config",
            "set-context",
            "stale",
            "--api-url",
            url,
            "--token-file",
            str(stale),
            "--ca-file",
            str(ca.cert_file),
        )
        for refused in (run("--context", "stale", "nodes", code=1), run("nodes", code=1, GPUCLOUD_CONTEXT="stale")):
            assert f"the token from context 'stale' ({stale}) is unknown or revoked at {url}" in refused
            assert (
                "gpucloud config view" in refused and "gpucloud config set-context stale --token-file PATH" in refused
            )
            assert "revoked-long-ago" not in refused

        # The environment over the context: its token, then its URL (named when it fails).
        run("--context", "stale", "nodes", GPUCLOUD_API__OPERATOR_TOKEN=OPERATOR_TOKEN)
        down = run("nodes", code=5, GPUCLOUD_API_URL="http://127.0.0.1:1")
        assert "cannot reach the API at http://127.0.0.1:1 (the URL from GPUCLOUD_API_URL)" in down
        wrong = run("nodes", code=1, GPUCLOUD_API__OPERATOR_TOKEN="gpcop_typo")
        assert f"the token from GPUCLOUD_API__OPERATOR_TOKEN is unknown or revoked at {url}" in wrong

        shown = json.loads(run("config", "view", "-o", "json", GPUCLOUD_CONTEXT="stale"))
        assert (shown["context"], shown["context_source"], shown["api_url"]) == ("stale", "GPUCLOUD_CONTEXT", url)
        assert shown["operator_token"]["source"] == f"context 'stale' ({stale})"
        assert shown["ca_file"] == str(ca.cert_file)
    assert list(cwd.iterdir()) == []  # no `.data`, no token made where the CLI ran
