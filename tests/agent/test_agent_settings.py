"""`gpucloud agent`'s options are settings too (`GPUCLOUD_AGENT__<OPTION>`, the `agent` section):
a setting gives an option its value, the flag given wins over it, and a misspelt one is refused
naming the setting it resembles, as every `GPUCLOUD_*` variable nothing reads is."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import app as cli
from gpucloud.config import Settings, UnknownSetting

pytestmark = pytest.mark.unit


@pytest.fixture
def started(monkeypatch, tmp_path) -> dict:
    """What the agent would run with: its entrypoint's `main`, stood in for."""
    ran: dict = {}
    monkeypatch.setattr("gpucloud.entrypoints.agent.main", lambda **options: ran.update(options))
    monkeypatch.setenv("GPUCLOUD_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("GPUCLOUD_AGENT__TOKEN_FILE", str(tmp_path / "no-credential-yet"))
    return ran


def test_a_setting_gives_an_agent_option_its_value_and_the_flag_wins(monkeypatch, started) -> None:
    monkeypatch.setenv("GPUCLOUD_AGENT__NODE_ID", "n-1")
    monkeypatch.setenv("GPUCLOUD_AGENT__TOKEN", "gpa_n-1.secret")
    monkeypatch.setenv("GPUCLOUD_AGENT__HEARTBEAT_S", "5")
    monkeypatch.setenv("GPUCLOUD_AGENT__TENANT_DISKS", '["/dev/nvme1n1"]')
    ran = CliRunner().invoke(cli, ["agent"])
    assert ran.exit_code == 0, ran.output
    assert (started["node_id"], started["token"], started["heartbeat_s"]) == ("n-1", "gpa_n-1.secret", 5.0)
    assert started["tenant_disks"] == ("/dev/nvme1n1",) and started["insecure"] is False
    assert started["reading_s"] == 30.0  # neither set nor given: the default

    ran = CliRunner().invoke(cli, ["agent", "--heartbeat-s", "2", "--tenant-disk", "/dev/sdb", "--insecure"])
    assert ran.exit_code == 0, ran.output
    assert (started["heartbeat_s"], started["tenant_disks"], started["insecure"]) == (2.0, ("/dev/sdb",), True)
    assert started["node_id"] == "n-1"  # the settings still give what no flag names


def test_a_bad_agent_setting_is_refused_as_its_flag_would_be(monkeypatch, started) -> None:
    monkeypatch.setenv("GPUCLOUD_AGENT__NODE_ID", "n-1")
    monkeypatch.setenv("GPUCLOUD_AGENT__TOKEN", "gpa_n-1.secret")
    monkeypatch.setenv("GPUCLOUD_AGENT__TENANT_DISKS", '["nvme1n1"]')
    ran = CliRunner().invoke(cli, ["agent"])
    assert ran.exit_code == 2 and "nvme1n1 is not a device path" in ran.output
    assert started == {}


def test_an_unknown_agent_setting_is_refused_naming_the_nearest(monkeypatch, started) -> None:
    monkeypatch.setenv("GPUCLOUD_AGENT__HEARTBEAT", "5")
    with pytest.raises(
        UnknownSetting, match=r"GPUCLOUD_AGENT__HEARTBEAT \(did you mean GPUCLOUD_AGENT__HEARTBEAT_S\?\)"
    ):
        Settings()
    ran = CliRunner().invoke(cli, ["agent", "--node-id", "n-1", "--token", "gpa_n-1.secret"])
    assert ran.exit_code == 2 and "did you mean GPUCLOUD_AGENT__HEARTBEAT_S?" in ran.output
    assert started == {}
