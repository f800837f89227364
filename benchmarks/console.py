"""The web console at fleet scale, against the API's JSON for the same nodes, in one run: the API
app served over HTTP (uvicorn on a thread, a SQLite database, an operator signed in), the fleet
enrolled in 8-node racks of 8-rack pods. Measures:

- `fleet_page_ms` at 1,000 and 10,000 nodes (`--sizes`): `GET /console/fleet`, every node a
  cell, p50 over `--rounds`; `api_json_ms`: every one of the same nodes through `GET /v1/nodes`
  (pages of 1,000, the most it gives), p50; `fleet_page_ratio` = page / JSON at each size.
  Target: <= 2.
- `first_paint_ms`: headless Chromium (the system's, through Playwright) loading the fleet page
  at the largest size, the Paint Timing API's first contentful paint (`performance.
  getEntriesByType('paint')`), p50 over `--paint-rounds` fresh loads. Target: <= 2,000 ms.
- `sse_ms_p50` / `sse_ms_p99`: from an operator's cordon or uncordon through the API
  (`POST /v1/nodes/{id}/cordon`, the answer received) to the cell's change in the browser's DOM
  (a MutationObserver stamps it), over `--changes` changes at random moments. Target: p99 <= 2,000 ms.

    python benchmarks/console.py [--sizes 1000,10000] [--quick]

Prints progress to stderr and one JSON line of figures last on stdout, each target with
whether it was met (`targets`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import log

from gpucloud.api.app import create_app
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.tables import NodeEnroll
from gpucloud.services import nodes as node_service
from gpucloud.web.serving import ThreadedServer

TOKEN = "bench-console-operator-token"
TARGETS = {"fleet_page_ratio": 2.0, "first_paint_ms": 2000.0, "sse_ms_p99": 2000.0}
# Records when each watched cell changes, in the page's own clock (ms since the epoch).
OBSERVE = """ids => {
  window.changes = [];
  const seen = new MutationObserver(records => {
    for (const r of records) {
      window.changes.push([r.target.id, Date.now(), r.target.classList.contains("cordoned")]);
    }
  });
  for (const id of ids) {
    seen.observe(document.getElementById("n-" + id), {attributes: true, attributeFilter: ["class"]});
  }
}"""


def enroll(url: str, first: int, count: int) -> None:
    specs = [
        NodeEnroll(
            id=f"n{i:05d}",
            hostname=f"n{i:05d}",
            agent_url="http://unused",
            region=f"r{i // 5000}",
            pod=f"pod{i // 64:03d}",
            rack=f"pod{i // 64:03d}-rack{(i % 64) // 8}",
            gpu_type="H100",
            gpu_count=8,
        )
        for i in range(first, first + count)
    ]
    with session_scope(url) as session:
        node_service.enroll_nodes(session, specs)


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def sign_in(client: httpx.Client) -> str:
    form = client.get("/console/sign-in")
    csrf = re.search(r'name="csrf_token" value="([^"]*)"', form.text)
    assert csrf is not None
    answer = client.post("/console/sign-in", data={"csrf_token": csrf.group(1), "token": TOKEN, "next": ""})
    assert answer.status_code == 303, answer.text
    return client.cookies["gpucloud_console"]


def page_and_json(console: httpx.Client, api: httpx.Client, nodes: int, rounds: int) -> tuple[float, float, int]:
    """p50 of the fleet page and of the same nodes as JSON, alternated round by round."""
    pages, jsons, size = [], [], 0
    for _ in range(rounds):
        started = time.perf_counter()
        answer = console.get("/console/fleet")
        pages.append((time.perf_counter() - started) * 1000)
        assert answer.status_code == 200 and answer.text.count('id="n-') == nodes, answer.status_code
        size = len(answer.content)
        started = time.perf_counter()
        seen, token = 0, ""
        while True:
            params: dict[str, str | int] = {"page_size": 1000, **({"page_token": token} if token else {})}
            listed = api.get("/v1/nodes", params=params)
            assert listed.status_code == 200, listed.text
            body = listed.json()
            seen += len(body["items"])
            token = body.get("next_page_token") or ""
            if not token:
                break
        jsons.append((time.perf_counter() - started) * 1000)
        assert seen == nodes, seen
    return statistics.median(pages), statistics.median(jsons), size


async def browser_figures(base: str, cookie: str, api: httpx.Client, nodes: int, options) -> dict:
    from playwright.async_api import async_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        log("no chromium on PATH: no first paint or SSE figures")
        return {}
    async with async_playwright() as driver:
        browser = await driver.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            context = await browser.new_context(viewport={"width": 1366, "height": 800})
            host = base.split("//", 1)[1].split(":")[0]
            await context.add_cookies(
                [{"name": "gpucloud_console", "value": cookie, "domain": host, "path": "/console"}]
            )
            page = await context.new_page()
            paints = []
            for round_ in range(options.paint_rounds):
                await page.goto(f"{base}/console/fleet", wait_until="load")
                await page.wait_for_function("() => performance.getEntriesByType('paint').length > 0", timeout=30_000)
                entries = await page.evaluate(
                    "Object.fromEntries(performance.getEntriesByType('paint').map(e => [e.name, e.startTime]))"
                )
                paints.append(entries.get("first-contentful-paint", entries.get("first-paint")))
                log(f"first paint {round_ + 1}: {paints[-1]:.0f} ms at {nodes} nodes")
            await page.wait_for_selector("#live", state="attached")
            await page.wait_for_function("() => document.getElementById('live').textContent.startsWith('live')")
            watched = [f"n{i:05d}" for i in random.Random(7).sample(range(nodes), options.changes)]
            await page.evaluate(OBSERVE, watched)
            latencies = []
            for i, node in enumerate(watched):
                await asyncio.sleep(random.Random(i).uniform(0.05, 0.6))  # at any moment of the stream's second
                answer = await asyncio.to_thread(api.post, f"/v1/nodes/{node}/cordon", json={"reason": "bench"})
                assert answer.status_code == 200, answer.text
                changed_at = time.time() * 1000
                await page.wait_for_function(
                    "id => window.changes.some(c => c[0] === id && c[2])", arg=f"n-{node}", timeout=10_000, polling=20
                )
                seen_at = next(c[1] for c in await page.evaluate("window.changes") if c[0] == f"n-{node}" and c[2])
                latencies.append(seen_at - changed_at)
            log(f"SSE: {len(latencies)} changes, p50 {p(latencies, 0.5):.0f} ms, max {max(latencies):.0f} ms")
            return {
                "first_paint_ms": round(statistics.median(paints), 1),
                "first_paint_ms_max": round(max(paints), 1),
                "sse_ms_p50": round(p(latencies, 0.5), 1),
                "sse_ms_p99": round(p(latencies, 0.99), 1),
                "sse_changes": len(latencies),
            }
        finally:
            await browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000", help="fleet sizes, ascending")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--paint-rounds", type=int, default=5)
    parser.add_argument("--changes", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="500 and 2,000 nodes, 3 rounds, 8 changes")
    options = parser.parse_args()
    if options.quick:
        options.sizes, options.rounds, options.paint_rounds, options.changes = "500,2000", 3, 2, 8
    sizes = sorted(int(s) for s in options.sizes.split(","))
    figures: dict = {"sizes": sizes}
    with tempfile.TemporaryDirectory() as root:
        settings = Settings(data_dir=Path(root), api={"operator_token": TOKEN})
        app = create_app(settings, temporal=object())  # type: ignore[arg-type]
        with ThreadedServer(app, name="api") as server:
            base = server.url
            headers = {"Authorization": f"Bearer {TOKEN}"}
            with (
                httpx.Client(base_url=base, timeout=120, follow_redirects=False) as console,
                httpx.Client(base_url=base, timeout=120, headers=headers) as api,
            ):
                cookie = sign_in(console)
                enrolled = 0
                ratios = {}
                for size in sizes:
                    log(f"enrolling up to {size} nodes")
                    enroll(settings.database_url, enrolled, size - enrolled)
                    enrolled = size
                    page_ms, json_ms, page_size = page_and_json(console, api, size, options.rounds)
                    ratios[size] = page_ms / json_ms
                    figures[f"fleet_page_ms_{size}"] = round(page_ms, 1)
                    figures[f"api_json_ms_{size}"] = round(json_ms, 1)
                    figures[f"fleet_page_ratio_{size}"] = round(ratios[size], 2)
                    figures[f"page_kib_{size}"] = round(page_size / 1024)
                    log(f"{size} nodes: page {page_ms:.0f} ms, JSON {json_ms:.0f} ms, ratio {ratios[size]:.2f}")
                figures["fleet_page_ratio"] = round(max(ratios.values()), 2)
                figures.update(asyncio.run(browser_figures(base, cookie, api, sizes[-1], options)))
    figures["targets"] = {
        name: {"target": f"<= {limit:g}", "value": figures.get(name), "met": figures.get(name, float("inf")) <= limit}
        for name, limit in TARGETS.items()
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
