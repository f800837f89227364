"""Settings refuse values that would make no sense, naming the setting."""

import os

import pytest
from pydantic import ValidationError

from gpucloud.config import Settings


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
