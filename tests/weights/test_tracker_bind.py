"""The tracker binds to its own setting, not to whatever host the URL nodes reach names."""

from __future__ import annotations

import pytest
import uvicorn

from gpucloud.config import Settings
from gpucloud.entrypoints import tracker

pytestmark = pytest.mark.unit


def test_the_tracker_binds_to_its_host_setting_and_listens_on_the_urls_port(monkeypatch, tmp_path) -> None:
    bound: dict = {}
    monkeypatch.setattr(tracker, "create_deployment_tracker", lambda settings: object())
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: bound.update(options))
    behind_a_balancer = {"url": "http://tracker.example.net:8480", "host": "127.0.0.1"}
    tracker.serve(Settings(data_dir=tmp_path, tracker=behind_a_balancer))
    assert (bound["host"], bound["port"]) == ("127.0.0.1", 8480)
    tracker.serve(Settings(data_dir=tmp_path, tracker={"url": "http://127.0.0.2:8481"}))
    assert (bound["host"], bound["port"]) == ("127.0.0.2", 8481)
