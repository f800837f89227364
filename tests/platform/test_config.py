"""Settings refuse values that would make no sense, naming the setting."""

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from gpucloud.config import NOT_SETTINGS, RETIRED_SETTINGS, Settings, UnknownSetting

pytestmark = pytest.mark.unit


def test_a_negative_provision_retry_budget_is_refused(monkeypatch):
    monkeypatch.setenv("GPUCLOUD_HEALTH__PROVISION_RETRIES", "-1")
    with pytest.raises(ValidationError, match="provision_retries"):
        Settings()
    monkeypatch.setenv("GPUCLOUD_HEALTH__PROVISION_RETRIES", "0")
    assert Settings().health.provision_retries == 0


def test_secrets_come_from_files_named_as_their_variables_and_the_environment_wins(monkeypatch, tmp_path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "GPUCLOUD_DATABASE__URL").write_text("postgresql+psycopg://gpucloud:s3cret@db/gpucloud\n")
    (secrets / "GPUCLOUD_OBJECT_STORE__SECRET_ACCESS_KEY").write_text("from-a-file")
    (secrets / "README").write_text("not a setting")
    monkeypatch.setenv("GPUCLOUD_SECRETS_DIR", str(secrets))
    settings = Settings()
    assert settings.database_url == "postgresql+psycopg://gpucloud:s3cret@db/gpucloud"
    assert "s3cret" not in repr(settings) and "from-a-file" not in repr(settings)  # never logged
    assert settings.object_store.secret_access_key.get_secret_value() == "from-a-file"
    monkeypatch.setenv("GPUCLOUD_OBJECT_STORE__SECRET_ACCESS_KEY", "from-the-environment")
    assert Settings().object_store.secret_access_key.get_secret_value() == "from-the-environment"
    monkeypatch.setenv("GPUCLOUD_SECRETS_DIR", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is not a directory"):
        Settings()


def test_a_worker_drains_for_as_long_as_the_settings_say(tmp_path):
    from datetime import timedelta
    from unittest import mock

    from gpucloud import bootstrap
    from gpucloud.workers.main import build_worker

    settings = Settings(data_dir=tmp_path, temporal={"worker_drain_s": 45})
    with mock.patch("gpucloud.workers.main.Worker") as worker:
        build_worker(mock.MagicMock(), bootstrap.control_plane(settings), executor=mock.MagicMock())
    assert worker.call_args.kwargs["graceful_shutdown_timeout"] == timedelta(seconds=45)


def test_a_free_port_is_handed_out_once_across_processes(monkeypatch, tmp_path):
    """Two processes drawing the same random port: the second is given another (the claim is a
    file in the temp dir, so it holds across processes)."""
    import itertools
    import socket
    import tempfile

    from gpucloud.devstack import stack

    # Two ports nothing listens on (another test's stack may hold any fixed one).
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        one, other = a.getsockname()[1], b.getsockname()[1]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    draws = itertools.chain([one, one, other])
    monkeypatch.setattr(stack._ports, "randint", lambda low, high: next(draws))
    first, second = stack.free_port(), stack.free_port()
    assert first == one and second == other
    assert (tmp_path / f"gpucloud-ports-{os.getuid()}" / str(one)).exists()


def test_a_control_plane_without_fabric_managers_or_ledger_says_what_tenants_go_without(tmp_path) -> None:
    from gpucloud import bootstrap

    bare = bootstrap.unconfigured(Settings(data_dir=tmp_path))
    assert len(bare) == 2
    assert "GPUCLOUD_FABRIC__URL" in bare[0] and "share the fabric" in bare[0]
    assert "GPUCLOUD_LEDGER__URL" in bare[1]
    whole = Settings(
        data_dir=tmp_path, fabric={"url": "https://fabric.internal:8800"}, ledger={"url": "https://l:8700"}
    )
    assert bootstrap.unconfigured(whole) == []


def test_the_api_url_is_the_configured_one_else_this_hosts_own_on_loopback_for_a_wildcard(tmp_path) -> None:
    assert Settings(data_dir=tmp_path, api={"url": "https://api.internal:8000/"}).api_url == "https://api.internal:8000"
    assert Settings(data_dir=tmp_path, api={"host": "0.0.0.0", "port": 9000}).api_url == "http://127.0.0.1:9000"
    with pytest.raises(ValueError, match="url"):
        Settings(data_dir=tmp_path, api={"url": "api.internal:8000"})


def _clean_environment(monkeypatch) -> None:
    for name in [k for k in os.environ if k.upper().startswith("GPUCLOUD_") and not k.startswith("GPUCLOUD_TEST_")]:
        monkeypatch.delenv(name)


def test_an_unknown_variable_stops_the_settings_naming_the_nearest_setting(monkeypatch, tmp_path) -> None:
    """The name before settings were nested was ignored without a word, and the process ran on
    SQLite; now it is refused, whether the settings come from the environment alone or not."""
    _clean_environment(monkeypatch)
    monkeypatch.setenv("GPUCLOUD_DATABASE_URL", "postgresql+psycopg://gpucloud@db/gpucloud")
    with pytest.raises(UnknownSetting, match=r"GPUCLOUD_DATABASE_URL \(did you mean GPUCLOUD_DATABASE__URL\?\)"):
        Settings()
    with pytest.raises(UnknownSetting, match="GPUCLOUD_DATABASE__URL"):
        Settings(data_dir=tmp_path)
    monkeypatch.delenv("GPUCLOUD_DATABASE_URL")
    monkeypatch.setenv("gpucloud_tempral__address", "db:7233")  # read whatever its case: refused whatever its case
    monkeypatch.setenv("GPUCLOUD_XYZZY", "1")
    with pytest.raises(UnknownSetting) as refused:
        Settings()
    assert "GPUCLOUD_TEMPRAL__ADDRESS (did you mean GPUCLOUD_TEMPORAL__ADDRESS?)" in str(refused.value)
    assert "GPUCLOUD_XYZZY (no setting is named like it)" in str(refused.value)


def test_settings_and_the_variables_read_elsewhere_pass(monkeypatch, tmp_path) -> None:
    """Every setting a parent exports to its children (`Settings.env`), each variable the code
    reads outside the settings, and the test suite's own."""
    _clean_environment(monkeypatch)
    exported = Settings(
        data_dir=tmp_path,
        database={"url": "postgresql+psycopg://u@db/g"},
        api={"workers": 2},
        agent={"tenant_disks": ["/dev/nvme1n1", "/dev/nvme2n1"]},
        bmc={"emulator_power_delay_s": (1, 2)},
    ).env()
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    for name in NOT_SETTINGS - RETIRED_SETTINGS - {"GPUCLOUD_SECRETS_DIR"}:
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("GPUCLOUD_TEST_SOMETHING_NEW", "1")
    monkeypatch.setenv("GPUCLOUD_API", '{"port": 9001}')  # a whole section as JSON
    settings = Settings()
    assert settings.database_url == "postgresql+psycopg://u@db/g" and settings.api.workers == 2
    # Lists and tuples travel as JSON, as the settings read them back.
    assert settings.agent.tenant_disks == ["/dev/nvme1n1", "/dev/nvme2n1"]
    assert settings.bmc.emulator_power_delay_s == (1, 2)
    # A retired setting is let through to the settings, which say what to do instead.
    monkeypatch.setenv("GPUCLOUD_TENANTS__DEFAULT_GPU_QUOTA", "8")
    with pytest.raises(ValidationError, match="no longer read"):
        Settings()


def test_a_secrets_file_named_as_no_setting_is_refused(monkeypatch, tmp_path) -> None:
    _clean_environment(monkeypatch)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "GPUCLOUD_DATABASE__URL").write_text("postgresql+psycopg://u@db/g\n")
    (secrets / "README").write_text("not a setting")
    monkeypatch.setenv("GPUCLOUD_SECRETS_DIR", str(secrets))
    assert Settings().database_url == "postgresql+psycopg://u@db/g"
    (secrets / "GPUCLOUD_LEDGER__DATABASE_ULR").write_text("postgresql+psycopg://u@db/ledger\n")
    with pytest.raises(UnknownSetting, match=r"in GPUCLOUD_SECRETS_DIR .*did you mean GPUCLOUD_LEDGER__DATABASE_URL"):
        Settings()
    # Read from the environment only (the agent's flags), so a file of that name is read by nobody.
    (secrets / "GPUCLOUD_LEDGER__DATABASE_ULR").unlink()
    (secrets / "GPUCLOUD_AGENT_TOKEN").write_text("gpcag_secret\n")
    with pytest.raises(UnknownSetting, match="GPUCLOUD_AGENT_TOKEN"):
        Settings()


def test_the_cli_refuses_an_unknown_variable_with_a_clear_line_and_exit_2(tmp_path) -> None:
    """`gpucloud up` with the old name of the database URL: it stops before it starts anything
    (on SQLite, which it would otherwise have done), saying which name was meant."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCLOUD_") or k.startswith("GPUCLOUD_TEST_")}
    env |= {"GPUCLOUD_DATA_DIR": str(tmp_path), "GPUCLOUD_DATABASE_URL": "postgresql+psycopg://gpucloud@db/gpucloud"}
    done = subprocess.run(
        [sys.executable, "-m", "gpucloud.cli.main", "up"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "GPUCLOUD_DATABASE_URL (did you mean GPUCLOUD_DATABASE__URL?)" in " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing started, no SQLite database made
