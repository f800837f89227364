"""temporal-dev.yaml becomes `temporal server start-dev` flags; search attributes declared once."""

from pathlib import Path

import pytest

from gpucloud.devstack.temporal_server import load_config, server_args
from gpucloud.models import search_attributes

pytestmark = pytest.mark.unit


def test_flags_from_yaml(tmp_path):
    args = server_args(tmp_path, port=17000)
    joined = " ".join(args)
    assert args[1:3] == ["server", "start-dev"] and Path(args[0]).name == "temporal"
    assert "--port 17000" in joined and "--ui-port 18000" in joined  # the UI 1000 above the server
    assert f"--db-filename {tmp_path / 'temporal.db'}" in joined
    assert "--sqlite-pragma journal_mode=wal" in joined
    for key in search_attributes.ALL:
        assert f"--search-attribute {key.name}=Keyword" in joined
    assert "--dynamic-config-value frontend.namespaceRPS=10000" in joined


def test_in_memory_and_headless(tmp_path):
    args = " ".join(server_args(tmp_path, port=17000, persist=False, headless=True))
    assert "--db-filename" not in args and "--sqlite-pragma" not in args
    assert "--headless" in args and "--ui-port" not in args


def test_yaml_must_declare_exactly_the_projects_search_attributes(tmp_path):
    cfg = load_config()
    cfg["search_attributes"] = {"NodeId": "Keyword"}
    with pytest.raises(ValueError, match="search_attributes"):
        server_args(tmp_path, config=cfg)
