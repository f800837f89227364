"""`gpucloud api --workers N`: several API processes on one port, on Postgres; refused on SQLite
with a message that says what to do."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gpucloud.config import Settings
from gpucloud.db import migrate
from gpucloud.devstack.stack import free_port
from support.codec import CODEC_KEYS
from support.databases import scratch_postgres

pytestmark = pytest.mark.integration

POSTGRES = os.environ.get("GPUCLOUD_TEST_POSTGRES_URL")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


@pytest.mark.skipif(not POSTGRES, reason="needs Postgres")
def test_two_api_processes_share_one_port_on_postgres(tmp_path, temporal_env):
    with scratch_postgres(POSTGRES) as url:
        settings = Settings(
            data_dir=tmp_path,
            database={"url": url},
            api={"port": free_port(), "operator_token": "op-token"},
            temporal={"address": temporal_env.client.service_client.config.target_host, "codec_keys": CODEC_KEYS},
            telemetry={"metrics_token": "metrics-token"},
        )
        migrate(url)  # the deployment step: API processes on Postgres only check the schema
        env = {**os.environ, **settings.env()}
        api = subprocess.Popen([sys.executable, "-m", "gpucloud.cli.main", "api", "--workers", "2"], env=env)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{settings.api_url}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert api.poll() is None and time.monotonic() < deadline, "the API did not come up"
                time.sleep(0.2)
            assert len(_children(api.pid)) >= 2  # uvicorn's two worker processes

            def list_nodes(_: int) -> int:
                """The answer, once the caller's lane admits it (a 429 says when to come back)."""
                headers = {"Authorization": "Bearer op-token"}
                for _attempt in range(20):
                    answer = httpx.get(f"{settings.api_url}/v1/nodes", headers=headers, timeout=30)
                    if answer.status_code != 429:
                        return answer.status_code
                    time.sleep(min(2.0, float(answer.headers["retry-after"])))
                return 429

            with ThreadPoolExecutor(8) as pool:
                assert set(pool.map(list_nodes, range(64))) == {200}
            # Whichever process answers the scrape, it counts the requests of both.
            scraped = httpx.get(
                f"{settings.api_url}/metrics", headers={"Authorization": "Bearer metrics-token"}, timeout=30
            ).text
            line = 'gpucloud_api_requests_total{method="GET",route="/v1/nodes",status="200"}'
            assert [float(x.rsplit(" ", 1)[1]) for x in scraped.splitlines() if x.startswith(line)] == [64.0]
        finally:
            api.terminate()
            api.wait(30)


def test_several_api_processes_on_sqlite_are_refused_with_what_to_do(tmp_path):
    env = {**os.environ, **Settings(data_dir=tmp_path, api={"port": free_port()}).env()}
    done = subprocess.run(
        [sys.executable, "-m", "gpucloud.cli.main", "api", "--workers", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "need Postgres" in done.stderr


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for whoever adopted it to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not POSTGRES, reason="needs Postgres")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_api_processes_die_with_a_master_killed_outright(tmp_path, temporal_env):
    """`kill -9` of the master runs none of its shutdown: its workers used to serve the port on,
    orphaned, with the old code, so the restarted API could not bind. Now each worker asked the
    kernel for SIGTERM when the master dies (`gpucloud/children.py`), and the port comes free."""
    with scratch_postgres(POSTGRES) as url:
        settings = Settings(
            data_dir=tmp_path,
            database={"url": url},
            api={"port": free_port(), "operator_token": "op-token"},
            temporal={"address": temporal_env.client.service_client.config.target_host, "codec_keys": CODEC_KEYS},
        )
        migrate(url)
        env = {**os.environ, **settings.env()}
        api = subprocess.Popen([sys.executable, "-m", "gpucloud.cli.main", "api", "--workers", "2"], env=env)
        workers: list[int] = []
        try:
            deadline = time.monotonic() + 120  # two processes importing the API on a loaded machine
            while True:
                try:
                    if httpx.get(f"{settings.api_url}/healthz", timeout=2).status_code == 200:
                        workers = _children(api.pid)
                        if len(workers) >= 2:  # uvicorn's two workers (and multiprocessing's tracker)
                            break
                except httpx.HTTPError:
                    pass
                assert api.poll() is None and time.monotonic() < deadline, "the API did not come up"
                time.sleep(0.2)
            api.kill()
            api.wait(10)
            deadline = time.monotonic() + 15
            while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert [pid for pid in workers if _running(pid)] == [], "API processes outlived their master"
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{settings.api_url}/healthz", timeout=2)
            with socket.socket() as again:  # a restarted API binds as uvicorn does
                again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                again.bind((settings.api.host, settings.api.port))
                again.listen()
        finally:
            api.kill()
            api.wait(10)
            for pid in workers:
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)
