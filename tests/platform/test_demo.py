"""The whole stack through the public API: `gpucloud demo` as a newcomer runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.long
def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "gpucloud.cli.main", "demo", "--nodes", "6", "--data-dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "demo succeeded" in output
    assert "allocation ready" in output and "allocation released" in output
    # Tenancy: two tenants, each its own VNI and prefix; a quota refusal, a foreign 404, a
    # rotated key, and the second tenant offboarded.
    assert "two tenants, side by side" in output and "second node refused" in output
    assert "HTTP 404" in output and "rotated its key" in output and "globex offboarded" in output
    # What a tenant may ask for: the catalogue, and a type the fleet has none of said as such.
    flat = " ".join(output.split())  # rich wraps lines
    assert "globex reads the catalog: H100 in us-east-1" in flat and "the fleet has no B200 nodes" in flat
    # The tenant logs in to a node with its workload's SSH key; after the release the key is refused.
    assert "`hostname` answers" in output and "refused after the release" in " ".join(output.split())
    # The health scenario: a GPU falls off the bus, its node is replaced, the allocation is ready.
    assert "XID 79 on" in output and "ready again" in output and "allocation events" in output
    # Rollouts: the production version out to the allocation, canary first, every node verified;
    # then the NaN candidate, refused on the canary by the sanity gate, every node on production again.
    assert "rollout succeeded" in output and "every file verified" in output
    assert "gates failed on the node: nan_inf_count (sanity)=1" in output and "rollout rolled back" in output
    assert "every node is back on" in output
    # Weights: the platform's sanity evaluator finds the NaN, and the gate refuses the candidate.
    assert "platform-signed" in output and "failing evaluation gates" in output
    assert "layers.7.weight" in output and "refused, as it should be" in output
    # Cleaning: acme's nodes booted once from the clean image through their BMCs' virtual media,
    # the booted digest checked, before the next tenant got them.
    assert "cleaned between tenants" in output and "image_inserted" in output and "image_verified" in output
    # The tenant reads its workload's output.
    assert "workload output" in output and "allocations logs" in output
    # The booted image, and only it, enrolled from its config drive.
    assert "enrollment_handed" in output and "agent_enrolled" in output
    assert "re-imaged out of band since acme held them" in " ".join(output.split())  # rich wraps lines
    # Billing: every millisecond the agents metered is in the ledger; the period's draft invoice.
    assert "the ledger holds exactly" in output and "draft until the period ends" in output
    # A full pool: a request queued, then placed; preemptible nodes taken back with notice for an
    # on-demand request; a capacity reservation ready by its start and ended on time.
    assert "queued at position" in flat and "placed on" in flat
    assert "preemption_notice" in flat and "initech's preempted" in flat
    assert "accepted" in flat and "ended on time" in flat and "before its start" in flat
    # The stack was stopped: nothing of it keeps running (its ports are free again).
    assert "'available': 6" in output
