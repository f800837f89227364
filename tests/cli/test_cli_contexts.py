"""The CLI's contexts (`gpucloud config`, `gpucloud.cli.contexts`): which API and token a command
uses and why, what it says when it has neither, and that a client never makes a token of its own.
Against a live API: tests/cli/test_cli_deployment_context.py."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpucloud.cli import contexts
from gpucloud.cli.main import app
from gpucloud.config import Settings
from gpucloud.web.tls import LocalCA
from support.forked import run_cli

pytestmark = pytest.mark.unit

OPERATOR_TOKEN = "gpcop_operator-secret-value"
TENANT_KEY = "gpc_key1.tenant-secret-value"


def flat(text: str) -> str:
    """Output as one line: rich wraps long lines wherever the terminal's width falls."""
    return re.sub(r"\s+", " ", text)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """An empty working directory and a shell that says nothing about gpucloud but where the
    CLI's config file is (the autouse `cli_config`)."""
    for name in [k for k in os.environ if k.startswith("GPUCLOUD_") and k != "GPUCLOUD_CONFIG"]:
        monkeypatch.delenv(name)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def secret_file(path: Path, token: str) -> Path:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def run(*args: str, code: int = 0, env: dict[str, str] | None = None, stdin: str | None = None) -> str:
    result = CliRunner().invoke(app, list(args), env=env, input=stdin)
    assert result.exit_code == code, result.output
    return result.output


def test_with_nothing_configured_a_command_says_what_to_do_and_creates_no_token(tmp_path) -> None:
    """From an empty directory with no gpucloud variable at all (a process of its own with only
    that environment, the home's default config path: `support.forked.run_cli`): usage error, the
    way to configure it, and no `.data` anywhere."""
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "COLUMNS": "400"}

    def gpucloud(*args: str) -> subprocess.CompletedProcess:
        return run_cli(list(args), env=env, cwd=cwd, timeout=60)

    for command in (
        ["nodes"],
        ["allocations", "list"],
        ["weights", "versions", "llama"],
        ["weights", "keys"],
        ["weights", "trust", "00" * 32],
        ["weights", "gates", "llama"],
        ["usage"],
    ):
        refused = gpucloud(*command)
        assert refused.returncode == 2, refused.stderr
        said = flat(refused.stderr)
        assert "the CLI does not know which API to call" in said
        assert "gpucloud config set-context NAME --api-url https://API --token-file PATH --use" in said
        assert "GPUCLOUD_API_URL" in said and "GPUCLOUD_API_KEY" in said
    assert "GPUCLOUD_API__OPERATOR_TOKEN" in flat(gpucloud("nodes").stderr)
    assert list(cwd.iterdir()) == [] and not (home / ".data").exists()
    assert list(home.iterdir()) == []  # nor a config file: only `gpucloud config` writes one

    # The default place, made private.
    token = secret_file(tmp_path / "operator_token", OPERATOR_TOKEN)
    made = gpucloud("config", "set-context", "prod", "--api-url", "https://api.example.com", "--token-file", str(token))
    assert made.returncode == 0, made.stderr
    config = home / ".config" / "gpucloud" / "config.yaml"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600 and stat.S_IMODE(config.parent.stat().st_mode) == 0o700


def test_contexts_round_trip_without_printing_a_token(elsewhere, cli_config, tmp_path) -> None:
    prod_token = secret_file(tmp_path / "prod_token", OPERATOR_TOKEN)
    ca = LocalCA(tmp_path / "ca")
    said = run(
        "config", "set-context", "prod", "--api-url", "https://api.example.com/", "--token-file", str(prod_token),
        "--ca-file", str(ca.cert_file), "--use",
    )  # fmt: skip
    assert "current context: prod" in said
    said += run("config", "set-context", "staging", "--api-url", "https://staging.example.com", "--token-stdin",
                stdin=TENANT_KEY + "\n")  # fmt: skip
    assert stat.S_IMODE(cli_config.stat().st_mode) == 0o600
    stored = contexts.load(cli_config)
    assert stored.current_context == "prod"
    assert stored.contexts["prod"].api_url == "https://api.example.com"  # no trailing slash
    assert stored.contexts["prod"].token_file == prod_token and stored.contexts["prod"].ca_file == ca.cert_file
    assert stored.contexts["staging"].token is not None  # kept in the 0600 file, as asked

    listed = json.loads(run("config", "get-contexts", "-o", "json"))
    assert [(c["name"], c["current"], c["token"], c["token_prefix"]) for c in listed] == [
        ("prod", True, "file", "gpcop_"),
        ("staging", False, "config file", "gpc_"),
    ]
    said += run("config", "get-contexts")
    assert "prod" in said and str(prod_token) in flat(said)
    said += run("config", "use-context", "staging")
    assert run("config", "current-context").splitlines()[0] == "staging"
    shown = run("--context", "prod", "config", "current-context")
    assert shown.splitlines()[0] == "prod" and "https://api.example.com" in shown
    assert "chosen by --context" in flat(shown)
    assert f"gpcop_… from {prod_token}" in flat(shown) and str(ca.cert_file) in flat(shown)
    said += shown
    shown = json.loads(run("config", "current-context", "-o", "json", env={"GPUCLOUD_CONTEXT": "prod"}))
    assert (shown["name"], shown["source"], shown["api_url"]) == ("prod", "GPUCLOUD_CONTEXT", "https://api.example.com")
    assert "overrides" not in run("config", "current-context")
    assert "GPUCLOUD_API_URL set here" in run(
        "config", "current-context", env={"GPUCLOUD_API_URL": "https://x.example"}
    )
    said += run("config", "view")
    said += run("config", "view", "-o", "json")
    # A partial update keeps what it does not name.
    said += run("config", "set-context", "staging", "--api-url", "https://staging2.example.com")
    assert contexts.load(cli_config).contexts["staging"].token is not None
    said += run("config", "delete-context", "staging")
    assert "no current context now" in said
    assert run("config", "current-context", code=1).startswith("no current context: no context is set in")
    assert OPERATOR_TOKEN not in said and TENANT_KEY not in said
    assert "secret" not in said  # no part of either token's secret half either
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["bad name!", "--api-url", "https://x.example"], "is not a context name"),
        (["a", "--api-url", "ftp://x.example"], "must be http:// or https://"),
        (["a", "--api-url", "https://user:pw@x.example"], "carries no credentials"),
        (["a"], "needs --api-url"),
        (["a", "--api-url", "https://x.example", "--token-file", "/nonexistent/token"], "does not exist"),
        (["a", "--api-url", "https://x.example", "--token-file", "{empty}"], "is empty"),
        (["a", "--api-url", "https://x.example", "--token-file", "{token}", "--token-stdin"], "not both"),
        (["a", "--api-url", "https://x.example", "--ca-file", "{token}"], "holds no PEM certificate"),
    ],
)
def test_set_context_refuses_bad_input_with_the_usage_code(elsewhere, cli_config, tmp_path, args, problem) -> None:
    files = {"{token}": str(secret_file(tmp_path / "token", OPERATOR_TOKEN)), "{empty}": str(tmp_path / "empty")}
    (tmp_path / "empty").write_text("\n")
    said = run("config", "set-context", *[files.get(a, a) for a in args], code=2)
    assert problem in flat(said)
    assert not cli_config.exists()


def test_unknown_contexts_and_broken_files_are_usage_errors(elsewhere, cli_config) -> None:
    assert "no context named 'nope'" in flat(run("config", "use-context", "nope", code=2))
    assert "no context named 'nope' (from --context)" in flat(run("--context", "nope", "nodes", code=2))
    said = flat(run("nodes", code=2, env={"GPUCLOUD_CONTEXT": "nope"}))
    assert "no context named 'nope' (from GPUCLOUD_CONTEXT)" in said and "gpucloud config set-context nope" in said
    cli_config.write_text("current_context: gone\ncontexts: {}\n")
    said = flat(run("nodes", code=2))
    assert str(cli_config) in said and "current_context 'gone' is not among its contexts" in said
    cli_config.write_text("contexts: [unclosed\n")
    assert "is not YAML" in flat(run("config", "get-contexts", code=2))


def test_a_context_without_a_token_says_how_to_give_it_one(elsewhere, cli_config, tmp_path) -> None:
    run("config", "set-context", "prod", "--api-url", "https://api.example.com", "--use")
    said = flat(run("nodes", code=2))
    assert "no token to call the API at https://api.example.com (from context 'prod')" in said
    assert "gpucloud config set-context prod --token-file PATH" in said
    gone = secret_file(tmp_path / "token", OPERATOR_TOKEN)
    run("config", "set-context", "prod", "--token-file", str(gone))
    gone.unlink()
    said = flat(run("allocations", "list", code=2))
    assert f"context 'prod' takes its token from {gone}, which cannot be read" in said


def test_flags_and_environment_override_the_context(elsewhere, cli_config, tmp_path, monkeypatch) -> None:
    token = secret_file(tmp_path / "prod_token", OPERATOR_TOKEN)
    ca = LocalCA(tmp_path / "ca")
    run("config", "set-context", "prod", "--api-url", "https://api.example.com", "--token-file", str(token),
        "--ca-file", str(ca.cert_file), "--use")  # fmt: skip
    run("config", "set-context", "other", "--api-url", "https://other.example.com", "--token-stdin", stdin="gpo_x.y")

    def resolved(**options) -> tuple[str, str, str, Path | None]:
        c = contexts.resolve(**options)
        return c.api_url, c.url_source, c.token_source, c.ca_file

    assert resolved(operator=True) == (
        "https://api.example.com", "context 'prod'", f"context 'prod' ({token})", ca.cert_file,
    )  # fmt: skip
    assert contexts.resolve(operator=True).token == OPERATOR_TOKEN
    assert resolved(context="other")[:2] == ("https://other.example.com", "context 'other'")
    monkeypatch.setenv("GPUCLOUD_CONTEXT", "other")
    assert resolved()[1] == "context 'other'"
    assert resolved(context="prod")[1] == "context 'prod'"  # --context wins over GPUCLOUD_CONTEXT
    monkeypatch.delenv("GPUCLOUD_CONTEXT")

    # The environment over the context, the options over both; the context's CA only for its URL.
    monkeypatch.setenv("GPUCLOUD_API_URL", "https://env.example.com")
    monkeypatch.setenv("GPUCLOUD_API__OPERATOR_TOKEN", "gpcop_from-env")
    assert resolved(operator=True) == (
        "https://env.example.com",
        "GPUCLOUD_API_URL",
        "GPUCLOUD_API__OPERATOR_TOKEN",
        None,
    )
    assert resolved(operator=False)[2] == f"context 'prod' ({token})"  # a tenant's command takes no operator token
    monkeypatch.setenv("GPUCLOUD_API_KEY", TENANT_KEY)
    assert resolved(operator=True)[2] == "GPUCLOUD_API_KEY"
    assert resolved(api_url="https://flag.example.com", api_key="gpc_k.s", operator=True)[:3] == (
        "https://flag.example.com", "--api-url", "--api-key",
    )  # fmt: skip
    shown = json.loads(run("config", "view", "-o", "json"))
    assert (shown["context"], shown["api_url"], shown["api_url_source"]) == (
        "prod", "https://env.example.com", "GPUCLOUD_API_URL",
    )  # fmt: skip
    assert shown["tenant_token"] == {"source": "GPUCLOUD_API_KEY", "prefix": "gpc_", "problem": None}
    assert shown["ca_file"] is None
    monkeypatch.setenv("GPUCLOUD_API_URL", "api.example.com")
    with pytest.raises(contexts.ConfigProblem, match=r"GPUCLOUD_API_URL: 'api\.example\.com' is not an API URL"):
        contexts.resolve()


def test_a_local_stack_in_the_environment_is_reached_without_a_context(elsewhere, tmp_path, monkeypatch) -> None:
    """`gpucloud up`'s shell: with no context, its settings give the URL, and its data dir's
    operator token is used where the stack made one; never made by the client."""
    data_dir = tmp_path / "stack"
    monkeypatch.setenv("GPUCLOUD_DATA_DIR", str(data_dir))
    monkeypatch.setenv("GPUCLOUD_API__PORT", "8123")
    said = flat(run("nodes", code=2))
    assert "no token to call the API at http://127.0.0.1:8123" in said
    assert "GPUCLOUD_API__PORT" in said and not data_dir.exists()
    data_dir.mkdir()  # as the stack's first start makes it
    secret_file(data_dir / "operator_token", OPERATOR_TOKEN)
    found = contexts.resolve(operator=True)
    assert (found.api_url, found.token) == ("http://127.0.0.1:8123", OPERATOR_TOKEN)
    assert found.token_source == f"GPUCLOUD_DATA_DIR ({data_dir / 'operator_token'})"
    # A tenant's command never takes the operator token from a data dir.
    with pytest.raises(contexts.ConfigProblem, match="GPUCLOUD_API_KEY"):
        contexts.resolve(operator=False)


def test_up_writes_a_local_context_current_only_where_none_is(elsewhere, cli_config, tmp_path) -> None:
    data_dir = tmp_path / "stack"
    ca = LocalCA(data_dir / "tls")
    settings = Settings(data_dir=data_dir, api={"port": 8124}, tls={"ca_file": ca.cert_file})
    first = contexts.remember_local_stack(settings)
    assert first.current and first.file == cli_config and first.token_file == data_dir.resolve() / "operator_token"
    local = contexts.load(cli_config).contexts["local"]
    assert (local.api_url, local.token_file, local.ca_file) == (
        "http://127.0.0.1:8124", data_dir.resolve() / "operator_token", ca.cert_file.resolve(),
    )  # fmt: skip
    assert not (data_dir / "operator_token").exists()  # the stack makes it, not the context

    run("config", "set-context", "prod", "--api-url", "https://api.example.com", "--use")
    moved = Settings(data_dir=data_dir, api={"port": 8125, "operator_token": "from-the-environment"})
    again = contexts.remember_local_stack(moved)
    assert not again.current and again.token_file is None  # a token from the environment is not copied
    stored = contexts.load(cli_config)
    assert stored.current_context == "prod" and stored.contexts["local"].api_url == "http://127.0.0.1:8125"
    assert "from-the-environment" not in cli_config.read_text()


def test_the_config_file_follows_xdg_unless_gpucloud_config_names_one(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("GPUCLOUD_CONFIG")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert contexts.config_path() == tmp_path / "home" / ".config" / "gpucloud" / "config.yaml"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/ignored")
    assert contexts.config_path() == tmp_path / "home" / ".config" / "gpucloud" / "config.yaml"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert contexts.config_path() == tmp_path / "xdg" / "gpucloud" / "config.yaml"
    monkeypatch.setenv("GPUCLOUD_CONFIG", str(tmp_path / "mine.yaml"))
    assert contexts.config_path() == tmp_path / "mine.yaml"


def test_a_run_inherits_no_context_option_from_the_run_before(elsewhere) -> None:
    """Tests (and anything else) run many commands in one process, some of them a group's alone."""
    from gpucloud.cli.common import root_context_option
    from gpucloud.cli.context_commands import config_app

    run("--context", "gone", "config", "get-contexts")
    assert root_context_option() is None
    assert CliRunner().invoke(config_app, ["current-context"]).exit_code == 1  # none, not 'gone'


def test_a_hand_written_context_names_its_files_in_full(elsewhere, cli_config) -> None:
    cli_config.write_text("contexts:\n  prod:\n    api_url: https://api.example.com\n    token_file: token\n")
    said = flat(run("config", "get-contexts", code=2))
    assert "contexts.prod.token_file: token is not an absolute path" in said
