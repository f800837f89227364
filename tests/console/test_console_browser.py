"""The web console in a real browser (the system's Chromium, driven by Playwright) against the
real stack: the API over HTTP, the production worker, the Temporal dev server and a simulated
fleet of 256 nodes (8 pods of 8 racks of 4), brought up once for the module's flows:

- an operator signs in, sees every node on the fleet map, watches a node injected with a fatal
  XID turn failed without a reload, cordons a node with a reason (the API shows the reason and the
  operator as the actor), is refused a POST without the CSRF token, and signs out;
- a tenant creates an allocation, sees the API's field error beside the field for a bad one,
  cancels it, and gets a 404 for another tenant's allocation; reads its queue, reservations,
  incidents, usage and models, and creates an API key whose secret it sees once;
- an operator follows that allocation (its nodes and events), reads the tenants, the queue, the
  incidents, the alerts, the rollouts, the reservations and billing, sees a node's readings
  charted, and drains a node (reason and confirmation; the API shows the drain and the operator);
- axe-core (vendored from npm under `tests/console/vendor/`, for this test only) scans each main
  page: no `serious` or `critical` violation.

`CONSOLE_SCREENSHOTS=<dir>` saves each page's screenshot there (docs/console/).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

# The browser's view of the stack; the console's queries on Postgres: its page tests.
pytestmark = [pytest.mark.e2e, pytest.mark.one_database]

playwright_api = pytest.importorskip("playwright.async_api")
CHROMIUM = shutil.which("chromium")
NODES = 256
SCREENSHOTS = os.environ.get("CONSOLE_SCREENSHOTS")
# A bound on the waits, not a speed claim: the map's stream looks for changes every second.
LIVE_WAIT_MS = 10_000
AXE = Path(__file__).parent / "vendor" / "axe-core-4.14.1.min.js"
# What a page must not have: axe's two worst impacts.
BLOCKING = ("serious", "critical")
AXE_RUN = """async () => {
  const result = await axe.run(document, {resultTypes: ["violations"]});
  return result.violations.map(v => ({id: v.id, impact: v.impact, help: v.help,
    nodes: v.nodes.slice(0, 3).map(n => n.target.join(" "))}));
}"""


async def _axe(page, name: str) -> None:
    """axe-core's scan of the page as it stands; fails on a serious or critical violation. The
    script is evaluated through the DevTools protocol, which the page's CSP does not govern (the
    page itself still loads nothing but its own origin's files)."""
    if not await page.evaluate("typeof window.axe !== 'undefined'"):
        await page.evaluate(await asyncio.to_thread(AXE.read_text))
    violations = await page.evaluate(AXE_RUN)
    blocking = [v for v in violations if v["impact"] in BLOCKING]
    assert not blocking, f"{name}: {blocking}"


async def _shot(page, name: str) -> None:
    if SCREENSHOTS:
        await asyncio.to_thread(os.makedirs, SCREENSHOTS, exist_ok=True)
        await page.screenshot(path=os.path.join(SCREENSHOTS, f"{name}.png"), full_page=False)


async def _sign_in(page, base: str, token: str) -> None:
    await page.goto(f"{base}/console")
    assert page.url.startswith(f"{base}/console/sign-in")
    await page.get_by_label("Operator token or tenant API key").fill(token)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_load_state()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")
async def test_operator_and_tenant_use_the_console_against_a_live_fleet(ready_fleet, db_url):
    h = await ready_fleet(nodes=NODES, latency_scale=0.02, timeout_s=180)
    base = h.api.url
    async with playwright_api.async_playwright() as driver:
        browser = await driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            context = await browser.new_context(viewport={"width": 1366, "height": 800})
            await _operator_flow(h, await context.new_page(), base)
            await context.close()
            allocation_id = await _tenant_flow(h, browser, base)
            await _operator_pages(h, browser, base, allocation_id)
        finally:
            await browser.close()


async def _operator_flow(h, page, base: str) -> None:
    await _sign_in(page, base, h.settings.operator_token)
    assert page.url == f"{base}/console/fleet"
    # Every node is a cell, in its rack, in its pod, in its region; state as text as well.
    cells = page.locator("#fleet a.cell")
    assert await cells.count() == NODES
    assert sorted(await cells.evaluate_all("els => els.map(e => e.id.slice(2))")) == sorted(h.node_ids())
    assert await page.locator("#fleet .rack").count() == NODES // 4
    first = h.node_ids()[0]
    assert "available" in (await page.locator(f"#n-{first}").get_attribute("aria-label") or "")

    # A fatal XID turns the node's cell failed while the page stays loaded.
    await page.evaluate("window.notReloaded = true")
    victim = h.node_ids()[5]
    xid = h.operator.post(f"/v1/nodes/{victim}/xid", json={"xid": 79, "gpu_index": 0})
    assert xid.status_code == 200, xid.text
    await page.wait_for_selector(f'#n-{victim}[data-health="failed"]', timeout=LIVE_WAIT_MS)
    assert await page.evaluate("window.notReloaded === true")
    assert "✕" in await page.locator(f"#n-{victim} i").inner_text()
    await _shot(page, "fleet")
    await _axe(page, "fleet")

    # Filters: one region's, one state's nodes.
    await page.get_by_label("State").select_option("available")
    await page.get_by_role("button", name="Filter").click()
    await page.wait_for_load_state()
    assert "state=available" in page.url
    shown = await page.locator("#fleet a.cell").evaluate_all("els => els.map(e => e.dataset.state)")
    assert shown and set(shown) == {"available"}

    # Cordon from the node's page: a reason and a confirmation, through the API's service.
    target = h.node_ids()[9]
    await page.goto(f"{base}/console/nodes/{target}")
    await page.get_by_label("Reason for the cordon").fill("fan noise on tray 2")
    await page.get_by_role("button", name="Cordon").click()  # not confirmed: asked again
    await page.wait_for_load_state()
    assert await page.locator("#node-cordoned").inner_text() == "no"
    await page.get_by_label(f"Yes, cordon node {target}").check()
    await page.get_by_role("button", name="Cordon").click()
    await page.wait_for_load_state()
    assert await page.locator("#node-cordoned").inner_text() == "yes"
    await _axe(page, "node")
    assert h.node(target)["cordoned"] is True
    events = h.operator.get(f"/v1/nodes/{target}/events").json()["items"]
    cordon = [e for e in events if e["event"] == "cordon"]
    assert cordon and cordon[-1]["cause"].endswith("fan noise on tray 2"), cordon
    assert cordon[-1]["actor"] == "operator:bootstrap"

    # A POST without the CSRF token (the browser's own cookie, a forged form) is refused.
    cookie = {c["name"]: c["value"] for c in await page.context.cookies()}["gpucloud_console"]
    forged = httpx.post(
        f"{base}/console/nodes/{target}/uncordon",
        data={"reason": "forged", "confirm": "yes"},
        cookies={"gpucloud_console": cookie},
    )
    assert forged.status_code == 403
    assert h.node(target)["cordoned"] is True

    await page.get_by_role("button", name="Sign out").click()
    await page.wait_for_load_state()
    assert page.url == f"{base}/console/sign-in"
    await page.goto(f"{base}/console/fleet")
    assert page.url.startswith(f"{base}/console/sign-in")


async def _tenant_flow(h, browser, base: str) -> str:
    _, key = await h.onboard()
    _, other_key = await h.onboard()
    others = h.allocate(other_key, node_count=1)
    page = await (await browser.new_context(viewport={"width": 1366, "height": 800})).new_page()
    await _sign_in(page, base, key)
    assert page.url == f"{base}/console/allocations"

    # A bad request: the API's message for the field, beside the field.
    await page.get_by_label("GPU type").fill("Z9000")
    await page.get_by_label("Region").fill("us-east-1")
    await page.get_by_label("Nodes").fill("1")
    await page.get_by_role("button", name="Create allocation").click()
    await page.wait_for_load_state()
    error = await page.locator("#gpu_type-error").inner_text()
    api = h.client(key).post("/v1/allocations", json={"gpu_type": "Z9000", "region": "us-east-1", "node_count": 1})
    assert api.status_code == 422
    assert api.json()["errors"][0]["field"] == "gpu_type" and api.json()["errors"][0]["message"] in error
    await _shot(page, "allocations")
    await _axe(page, "allocations (a field error)")

    await page.get_by_label("GPU type").fill("H100")
    await page.get_by_role("button", name="Create allocation").click()
    await page.wait_for_load_state()
    assert "/console/allocations/alloc" in page.url
    allocation_id = page.url.rsplit("/", 1)[1]
    assert h.client(key).get(f"/v1/allocations/{allocation_id}").status_code == 200

    await page.get_by_label(f"Yes, cancel allocation {allocation_id}").check()
    await page.get_by_role("button", name="Cancel allocation").click()
    await page.wait_for_load_state()
    assert h.client(key).get(f"/v1/allocations/{allocation_id}").json()["desired"] == "cancelled"
    # The page after the cancel (a click's navigation may still be under way when the API answers).
    await playwright_api.expect(page.locator("#allocation-status")).to_have_text(
        re.compile("cancelling|released"), timeout=15_000
    )
    await page.evaluate("window.notReloaded = true")
    # The page follows the allocation to its end without a reload (htmx polls its status).
    await page.locator("#allocation-status", has_text="released").wait_for(timeout=60_000)
    assert await page.evaluate("window.notReloaded === true")

    # Another tenant's allocation is no one's here, as in the API.
    answer = await page.goto(f"{base}/console/allocations/{others}")
    assert answer is not None and answer.status == 404

    for path, heading in (
        ("queue", "Queue"),
        ("reservations", "Reservations"),
        ("incidents", "Incidents"),
        ("usage", "Usage and invoices"),
        ("models", "Models"),
    ):
        await page.get_by_role("navigation", name="Console").get_by_role("link", name=heading.split(" ")[0]).click()
        await page.wait_for_load_state()
        assert page.url.startswith(f"{base}/console/{path}")
        assert heading in await page.locator("h1").inner_text()
        await _axe(page, path)

    # A new key: its secret shown once, in this answer only.
    await page.get_by_role("link", name="API keys").click()
    await page.get_by_role("button", name="Create a key").click()
    await page.wait_for_load_state()
    secret = await page.get_by_label("The new key's secret").input_value()
    assert secret.startswith("gpc_") and h.client(secret).get("/v1/api-keys").status_code == 200
    await _axe(page, "api keys (a new key)")
    await page.goto(f"{base}/console/api-keys")
    assert secret not in await page.content()
    await _shot(page, "api_keys")
    return allocation_id


def _readings(node_id: str) -> list[dict]:
    """Ten readings a minute apart: corrected ECC errors creeping up, temperatures moving."""
    from support.readings import node_reading

    now = datetime.now(UTC).replace(microsecond=0)
    out = []
    for i in range(10):
        reading = node_reading(
            node_id, now - timedelta(minutes=10 - i), corrected=i
        )  # 9 in 9 minutes: below the trend rule's rate
        gpus = tuple(g.model_copy(update={"temperature_c": 55 + (i * 7 + g.index) % 17}) for g in reading.gpus)
        out.append(reading.model_copy(update={"gpus": gpus}).model_dump(mode="json"))
    return out


async def _operator_pages(h, browser, base: str, allocation_id: str) -> None:
    page = await (await browser.new_context(viewport={"width": 1366, "height": 800})).new_page()
    await _sign_in(page, base, h.settings.operator_token)

    # The tenant's allocation, found through the filters, with its nodes and events.
    await page.get_by_role("navigation", name="Console").get_by_role("link", name="Allocations").click()
    await page.get_by_label("Status").select_option("released")
    await page.get_by_role("button", name="Filter").click()
    await page.wait_for_load_state()
    assert "status=released" in page.url
    await page.get_by_role("link", name=allocation_id).click()
    await page.wait_for_load_state()
    events = await page.locator("table.events tbody").inner_text()
    assert "tenant:" in events  # the create and the cancel, with the key that made them
    assert await page.locator("table.nodes tbody tr").count() >= 1
    await _shot(page, "allocation")
    await _axe(page, "allocation")

    for path, name in (
        ("tenants", "Tenants"),
        ("queue", "Queue"),
        ("incidents", "Incidents"),
        ("alerts", "Alerts"),
        ("rollouts", "Rollouts"),
        ("reservations", "Reservations"),
        ("billing", "Billing"),
    ):
        await page.get_by_role("navigation", name="Console").get_by_role("link", name=name).click()
        await page.wait_for_load_state()
        assert page.url.startswith(f"{base}/console/{path}") and name in await page.locator("h1").inner_text()
        await _axe(page, path)
    await page.goto(f"{base}/console/tenants")
    await page.locator("table tbody a").first.click()
    await page.wait_for_load_state()
    assert await page.locator("#quota-usage").count() == 1
    await _shot(page, "tenant")
    await _axe(page, "tenant")

    # A node's readings as charts, from what its agent posted.
    node = h.node_ids()[20]
    posted = h.operator.post("/v1/agents/readings", json={"readings": _readings(node)})
    assert posted.status_code == 200, posted.text
    await page.goto(f"{base}/console/nodes/{node}")
    assert "corrected: latest 9," in await page.locator("#chart-ecc").inner_text()
    assert await page.locator("#chart-temperature svg polyline").count() == 1

    # Drain: a reason and a confirmation; the API shows it with the operator's name.
    await page.get_by_label("Reason for the drain").fill("ECC errors rising on GPU 2")
    await page.get_by_label(f"Yes, drain node {node}").check()
    await page.get_by_role("button", name="Drain").click()
    await page.wait_for_load_state()
    assert "Drain requested" in await page.locator(".notice").inner_text()
    assert await page.locator("#node-cordoned").inner_text() == "yes"
    await _shot(page, "node")
    await _axe(page, "node (charts, drained)")
    drained = [e for e in h.operator.get(f"/v1/nodes/{node}/events").json()["items"] if e["event"] == "drain"]
    # The operator's intent (then the workflow's own step to draining).
    mine = [e for e in drained if e["actor"] == "operator:bootstrap"]
    assert mine and mine[0]["cause"].endswith("ECC errors rising on GPU 2"), drained

    # At a laptop's width nothing is wider than the window.
    await page.set_viewport_size({"width": 1280, "height": 800})
    assert await page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
