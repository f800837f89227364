"""The deployment files say only what the code understands: every command they run is a
`gpucloud` command with options it has, every `GPUCLOUD_*` variable is a setting, the systemd
units pass `systemd-analyze verify`, and the Dockerfile runs as a non-root user."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gpucloud.cli.main import app
from gpucloud.config import NOT_SETTINGS, NOT_SETTINGS_PREFIXES, Settings, setting_names
from support.systemd import Host

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), DEPLOY / "compose.yaml"]


def is_setting(name: str) -> bool:
    """A setting, or a variable the code reads by that name (`config.NOT_SETTINGS`, the one list)."""
    return name in setting_names() or name in NOT_SETTINGS or name.startswith(NOT_SETTINGS_PREFIXES)


def assert_runs(argv: list[str]) -> None:
    """`gpucloud <argv>` names a command, and each of its options is one the command has."""
    command = [a for a in argv if not a.startswith("-")][:1]
    assert command, argv
    shown = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    assert shown.exit_code == 0, f"gpucloud {command[0]}: {shown.output}"
    for option in (a for a in argv if a.startswith("--")):
        assert option in shown.output, f"gpucloud {command[0]} has no option {option}"


def test_compose_runs_real_commands_with_real_settings() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    ours = {name: s for name, s in compose["services"].items() if s.get("image") == "gpucloud:latest"}
    assert {"migrate", "api", "worker", "ledger", "tracker", "sim", "fabric"} <= set(ours)
    assert compose["services"]["worker"]["deploy"]["replicas"] >= 3
    assert "--workers" in compose["services"]["api"]["command"]
    for name, service in ours.items():
        assert_runs(service["command"])
        for variable in service["environment"]:
            assert is_setting(variable), f"{name}: {variable} is not a setting"
        if name != "migrate":  # the processes start only after the migration step
            assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert ours["api"]["environment"]["GPUCLOUD_DATABASE__MIGRATE_ON_START"] == "false"


def test_compose_settings_validate_and_publish_plain_http_on_loopback_only(monkeypatch) -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for name in [k for k in os.environ if k.startswith("GPUCLOUD_")]:
        monkeypatch.delenv(name)
    for name, service in compose["services"].items():
        environment = service.get("environment") or {}
        if service.get("image") == "gpucloud:latest":
            with monkeypatch.context() as own:  # each service with its own variables only
                for variable, value in environment.items():
                    if variable != "GPUCLOUD_SECRETS_DIR":
                        own.setenv(variable, str(value))
                Settings()  # Temporal off loopback: refused unless TLS or allow_insecure
        plain_http = environment.get("GPUCLOUD_TLS__INSECURE") == "true" or service.get("image") != "gpucloud:latest"
        for published in service.get("ports", []):
            if plain_http:
                assert str(published).startswith("127.0.0.1:"), f"{name} publishes {published} without TLS"


def test_every_variable_the_documents_name_is_read() -> None:
    """A variable named in a guide is a setting, or one the code reads by that name: a misspelt
    one is silently ignored, which the operator finds out only when it matters."""
    unknown = {
        (document.name, name.rstrip("_"))
        for document in DOCUMENTS
        for name in re.findall(r"GPUCLOUD_[A-Z0-9_]+", document.read_text())
        if not name.startswith("GPUCLOUD_TEST_") and not is_setting(name.rstrip("_"))
    }
    assert unknown == set()
    readers = [*ROOT.glob("gpucloud/**/*.py"), *ROOT.glob("tests/**/*.py"), *UNITS]  # a unit's ExecStart= reads too
    code = "\n".join(p.read_text() for p in readers)
    assert [name for name in sorted(NOT_SETTINGS) if code.count(name) < 2] == []  # in config.py, and where it is read


def test_the_environment_files_name_only_settings() -> None:
    for example in sorted(DEPLOY.glob("*.env.example")):
        for line in example.read_text().splitlines():
            if line and not line.startswith("#"):
                name = line.split("=", 1)[0]
                assert is_setting(name), f"{example.name}: {name}"


def test_worker_instances_on_one_host_get_their_own_metrics_ports(tmp_path: Path) -> None:
    """By systemd's rules (`support.systemd`): the environment file, copied as shipped, overrides
    the unit's Environment=, so it must leave the port to each instance."""
    host = Host(tmp_path)
    host.install(DEPLOY / "gpucloud.env.example", "/etc/gpucloud/gpucloud.env")
    ports = {i: host.unit(f"gpucloud-worker@{i}").environment().get("GPUCLOUD_TELEMETRY__WORKER_PORT") for i in "45"}
    assert ports == {"4": "9464", "5": "9465"}, ports
    # The rule itself: a port in the environment file would win over both instances' own.
    env_file = host.path("/etc/gpucloud/gpucloud.env")
    env_file.write_text(env_file.read_text() + "GPUCLOUD_TELEMETRY__WORKER_PORT=9464\n")
    assert {host.unit(f"gpucloud-worker@{i}").environment()["GPUCLOUD_TELEMETRY__WORKER_PORT"] for i in "45"} == {
        "9464"
    }


def test_units_run_real_commands_and_pass_systemd_analyze(tmp_path: Path) -> None:
    for unit in UNITS:
        text = unit.read_text().replace("\\\n", " ")
        [exec_start] = re.findall(r"^ExecStart=(.*)$", text, re.MULTILINE)
        argv = exec_start.split()
        assert argv[0] == "/opt/gpucloud/bin/gpucloud", unit.name
        assert_runs([a for a in argv[1:] if not a.startswith("${")])
        for variable in re.findall(r"^Environment=(GPUCLOUD_\w+)=", text, re.MULTILINE):
            assert is_setting(variable), f"{unit.name}: {variable}"
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    root = tmp_path / "root"
    (root / "opt/gpucloud/bin").mkdir(parents=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    executable = root / "opt/gpucloud/bin/gpucloud"
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    for unit in UNITS:
        shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    names = [u.name.replace("@.service", "@4.service") for u in UNITS]
    verified = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", f"--root={root}", *names], capture_output=True, text=True
    )
    assert verified.returncode == 0 and not (verified.stdout + verified.stderr).strip(), verified.stderr


def test_the_image_runs_gpucloud_as_a_non_root_user_without_the_embedded_server() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM ", dockerfile, re.MULTILINE)
    assert len(stages) == 2  # build, then a runtime stage with only the virtual environment
    assert re.search(r"^USER gpucloud", dockerfile, re.MULTILINE)
    assert 'ENTRYPOINT ["gpucloud"]' in dockerfile
    assert "pip install ." in dockerfile and "embedded" not in dockerfile.split("pip install .")[1].split("\n")[0]


def test_the_compose_evaluation_worker_gets_the_payload_keys_and_no_other_secret() -> None:
    evaluations = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["evaluations"]
    mounted = [volume.split(":")[0] for volume in evaluations["volumes"]]
    assert mounted == ["./secrets/GPUCLOUD_TEMPORAL__CODEC_KEYS"]  # no data volume, no other secret
    variables = set(evaluations["environment"])
    assert not {v for v in variables if v.startswith(("GPUCLOUD_DATABASE", "GPUCLOUD_OBJECT_STORE"))}
    assert "GPUCLOUD_TEMPORAL__ALLOW_INSECURE" in variables  # Temporal off loopback, on the private network


# Variables of gpucloud.env the compose file has no use for, and why: its services talk over a
# private bridge without TLS, and each binds its own address; the API URL others reach is the
# service name (from API__HOST); the worker's metrics bind is set per service.
HOST_ONLY = {
    "GPUCLOUD_DATA_DIR": "the image's default, the data volume",
    "GPUCLOUD_TEMPORAL__TLS": "plain gRPC on the private bridge (ALLOW_INSECURE)",
    "GPUCLOUD_TEMPORAL__TLS_CA_FILE": "no TLS on the bridge",
    "GPUCLOUD_TEMPORAL__TLS_CERT_FILE": "no TLS on the bridge",
    "GPUCLOUD_TEMPORAL__TLS_KEY_FILE": "no TLS on the bridge",
    "GPUCLOUD_TLS__CERT_FILE": "no TLS on the bridge (TLS__INSECURE)",
    "GPUCLOUD_TLS__KEY_FILE": "no TLS on the bridge",
    "GPUCLOUD_TLS__CA_FILE": "no TLS on the bridge",
    "GPUCLOUD_API__URL": "derived from API__HOST, the service's name",
    "GPUCLOUD_API__WORKERS": "the api service's --workers",
    "GPUCLOUD_API__DELEGATE_KEY": "the default path in the data volume (the api-delegate step)",
    "GPUCLOUD_LEDGER__HOST": "set on the ledger service",
    "GPUCLOUD_TRACKER__HOST": "the tracker's URL names 0.0.0.0",
    "GPUCLOUD_TELEMETRY__WORKER_HOST": "set on the worker service",
}


def test_compose_runs_what_the_units_run_with_the_same_preparation_and_variables() -> None:
    """One deployment two ways: each control-plane unit's command is a compose service's, the
    preparation step is the same `gpucloud prepare`, and every variable of the units' environment
    file is set by compose too, or is listed in HOST_ONLY with the reason it is not."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    ours = {name: s for name, s in compose["services"].items() if s.get("image") == "gpucloud:latest"}
    commands = {tuple(s["command"]) for s in ours.values()}
    for unit in UNITS:
        if unit.name == "gpucloud-agent.service":  # compose runs a simulated fleet instead of nodes
            continue
        [exec_start] = re.findall(r"^ExecStart=(.*)$", unit.read_text().replace("\\\n", " "), re.MULTILINE)
        command = tuple(exec_start.split()[1:])
        assert any(c[: len(command)] == command for c in commands), f"{unit.name}: no compose service runs {command}"
    assert ours["migrate"]["command"] == ["prepare"]
    shared = set(compose["x-gpucloud"]["environment"])
    example = {
        line.split("=", 1)[0]
        for line in (DEPLOY / "gpucloud.env.example").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert example - shared - set(HOST_ONLY) == set()
    assert set(HOST_ONLY) <= example  # no stale reasons
