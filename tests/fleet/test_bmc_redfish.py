"""The BMC client against a real Redfish server: the sushy-tools emulator over HTTP, and a
faulty proxy in front of it for what the emulator cannot do wrong on its own. Every bad BMC
behaviour gives a typed error that says whether trying again can help, within bounded time."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpucloud.adapters.bmc import BmcCredentials, BmcEndpoint, BmcError, RedfishBmc, discover
from gpucloud.devstack.stack import free_port
from gpucloud.sim.bmc import CREDENTIAL_REF, USERNAME, BmcEmulator, sim_bmc_password, system_id_of, write_sim_credential
from support.faulty_http import FaultyProxy, FileServer

pytestmark = pytest.mark.integration

NODES = ["gpu-a", "gpu-b"]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Iterator[BmcEmulator]:
    data_dir = tmp_path_factory.mktemp("bmc")
    # Power changes apply 1 to 2 s after they are asked for (the emulator's own draw: 1 to 11).
    emulator = BmcEmulator(data_dir, free_port(), NODES, power_delay_s=(1, 2))
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.stop()


def _bmc(emulator: BmcEmulator, node: str = "gpu-a", *, url: str | None = None, password: str | None = None, **kw):
    secret = password or sim_bmc_password(emulator.data_dir)
    endpoint = BmcEndpoint(url or emulator.url, system_id_of(node), USERNAME, secret)
    return RedfishBmc(endpoint, timeout_s=kw.pop("timeout_s", 5.0), poll_s=0.5, **kw)


def test_power_actions_are_idempotent_and_waited_for(emulator: BmcEmulator) -> None:
    bmc = _bmc(emulator)
    assert bmc.power_state() == "On"
    assert bmc.power("on") == "already on"  # nothing sent
    answer = bmc.power("off")
    assert answer.startswith("ForceOff accepted; power On -> Off") and bmc.power_state() == "Off"
    assert bmc.power("off") == "already off"
    assert "On accepted; power Off -> On" in bmc.power("cycle")  # off already: only the on
    cycled = bmc.power("cycle")
    assert "ForceOff accepted" in cycled and "On accepted" in cycled and bmc.power_state() == "On"
    # The other node's system was not touched.
    assert _bmc(emulator, "gpu-b").power_state() == "On"


def test_the_emulators_power_delay_is_the_range_it_was_given(emulator: BmcEmulator) -> None:
    """Six changes on an emulator told 1 to 2 s each apply within 4 s (its own draw, 1 to 11 s,
    would take longer at least once in all but 2 runs in a thousand)."""
    bmc = _bmc(emulator, "gpu-b")
    for action, state in [("off", "Off"), ("on", "On")] * 3:
        started = time.monotonic()
        assert bmc.power(action).startswith(("ForceOff accepted", "On accepted")) and bmc.power_state() == state
        assert time.monotonic() - started < 4.0, action


def test_a_power_delay_range_the_emulator_cannot_draw_is_refused() -> None:
    from pydantic import ValidationError

    from gpucloud.config import BmcSettings
    from gpucloud.entrypoints.bmc_emulator import PowerDelays

    for low, high in ((0, 2), (3, 2)):
        with pytest.raises(ValueError, match="1 <= low <= high"):
            PowerDelays(low, high)
        with pytest.raises(ValidationError, match="1 <= low <= high"):
            BmcSettings(emulator_power_delay_s=(low, high))
    assert {PowerDelays(2, 3).randint(1, 11) for _ in range(200)} == {2, 3}


def test_discovery_lists_every_system_with_what_the_bmc_reports(emulator: BmcEmulator) -> None:
    systems = discover(emulator.url, USERNAME, sim_bmc_password(emulator.data_dir), timeout_s=5)
    assert sorted(s.name for s in systems) == NODES
    first = next(s for s in systems if s.name == "gpu-b")
    assert first.system_id == system_id_of("gpu-b") and first.power_state == "On"
    assert first.manufacturer == "Sushy Emulator"  # what the emulator's fake systems report
    assert "serial_number" not in first.as_record()  # nothing made up for what it does not report


def test_credentials_are_references_resolved_in_the_secrets_directory(emulator: BmcEmulator, tmp_path: Path) -> None:
    write_sim_credential(emulator.data_dir, tmp_path / "creds")
    assert oct((tmp_path / "creds" / CREDENTIAL_REF).stat().st_mode & 0o777) == "0o600"
    assert BmcCredentials(tmp_path / "creds").resolve(CREDENTIAL_REF) == (USERNAME, sim_bmc_password(emulator.data_dir))
    for bad in ("missing", "../etc/passwd", ""):
        with pytest.raises(BmcError) as found:
            BmcCredentials(tmp_path / "creds").resolve(bad)
        assert found.value.kind == "auth" and not found.value.retryable


def test_wrong_credentials_and_a_missing_system_are_final(emulator: BmcEmulator) -> None:
    with pytest.raises(BmcError) as wrong:
        _bmc(emulator, password="not-the-password").power_state()
    assert wrong.value.kind == "auth" and not wrong.value.retryable and "refused the credentials" in str(wrong.value)
    with pytest.raises(BmcError) as missing:
        _bmc(emulator, "no-such-node").power("on")
    assert missing.value.kind == "not_found" and not missing.value.retryable


def test_an_unreachable_bmc_is_retryable_and_fails_fast() -> None:
    started = time.monotonic()
    endpoint = BmcEndpoint(f"http://127.0.0.1:{free_port()}", system_id_of("gpu-a"), USERNAME, "x")
    with pytest.raises(BmcError) as down:
        RedfishBmc(endpoint, timeout_s=2).power_state()
    assert down.value.kind == "unreachable" and down.value.retryable
    assert time.monotonic() - started < 10


def test_5xx_garbage_timeouts_and_a_reset_that_never_happens(emulator: BmcEmulator) -> None:
    with FaultyProxy(emulator.url, hang_s=6) as proxy:
        bmc = _bmc(emulator, "gpu-b", url=proxy.url, timeout_s=2.0, power_wait_s=3.0)
        assert bmc.power_state() == "On"  # through the proxy, passing

        proxy.mode = "error_500"
        with pytest.raises(BmcError) as failed:
            _bmc(emulator, "gpu-b", url=proxy.url).power_state()
        assert failed.value.kind == "server_error" and failed.value.retryable

        proxy.mode = "garbage"
        with pytest.raises(BmcError) as garbage:
            _bmc(emulator, "gpu-b", url=proxy.url).power_state()
        assert garbage.value.kind == "server_error" and garbage.value.retryable

        proxy.mode = "hang"
        started = time.monotonic()
        with pytest.raises(BmcError) as hung:
            bmc.power_state()
        assert hung.value.kind == "timeout" and hung.value.retryable
        assert time.monotonic() - started < 5  # bounded by the client's timeout, not the BMC

        proxy.mode = "swallow_resets"
        started = time.monotonic()
        with pytest.raises(BmcError) as stuck:
            bmc.power("off")
        assert stuck.value.kind == "stuck" and "still On after 3 s" in str(stuck.value)
        assert time.monotonic() - started < 10
        proxy.mode = "pass"
        assert bmc.power_state() == "On"  # nothing happened to the system


def test_firmware_update_through_the_update_service_or_unsupported(emulator: BmcEmulator) -> None:
    # The emulator's fake systems cannot update firmware: its SimpleUpdate fails, which is
    # `unsupported` (the repair ladder then reflashes through the agent).
    with pytest.raises(BmcError) as refused:
        _bmc(emulator).firmware_update("https://firmware.example/h100-bios-1.2.bin")
    assert refused.value.kind == "unsupported" and "cannot update" in str(refused.value)
    with FaultyProxy(emulator.url) as proxy:
        proxy.mode = "accept_updates"
        answer = _bmc(emulator, url=proxy.url).firmware_update("https://firmware.example/h100-bios-1.2.bin")
    assert answer.startswith("SimpleUpdate of /redfish/v1/Systems/") and "h100-bios-1.2.bin" in answer
    assert ("POST", "/redfish/v1/UpdateService/Actions/UpdateService.SimpleUpdate") in proxy.requests


def test_discovery_merges_what_a_real_bmc_reports(emulator: BmcEmulator) -> None:
    """Serial number, model, CPUs, memory and BIOS, as a real server's BMC reports them (the
    emulator's fake systems report none, so a proxy adds them to its answers)."""
    with FaultyProxy(emulator.url) as proxy:
        proxy.mode = "real_hardware"
        systems = discover(proxy.url, USERNAME, sim_bmc_password(emulator.data_dir), timeout_s=5)
        single = _bmc(emulator, "gpu-a", url=proxy.url).system()
    record = next(s for s in systems if s.name == "gpu-a").as_record()
    assert record["serial_number"] == "SN-7Z23A01B" and record["model"].startswith("ThinkSystem SR675")
    assert (record["cpu_count"], record["memory_gib"], record["bios_version"]) == (2, 2048.0, "KAE120H-2.10")
    assert single.as_record() == record


def test_the_cli_lists_a_bmcs_systems_and_names_a_bad_credential(emulator: BmcEmulator, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gpucloud.cli.main import app

    write_sim_credential(emulator.data_dir, tmp_path / "creds")
    env = {"GPUCLOUD_BMC__CREDENTIALS_DIR": str(tmp_path / "creds"), "COLUMNS": "200"}
    listed = CliRunner().invoke(app, ["bmc", "systems", "--url", emulator.url, "--credential", CREDENTIAL_REF], env=env)
    assert listed.exit_code == 0, listed.output
    assert system_id_of("gpu-a") in listed.output and "gpu-b" in listed.output
    as_json = CliRunner().invoke(
        app, ["bmc", "systems", "--url", emulator.url, "--credential", CREDENTIAL_REF, "--output", "json"], env=env
    )
    assert sorted(s["name"] for s in json.loads(as_json.output)) == NODES
    missing = CliRunner().invoke(app, ["bmc", "systems", "--url", emulator.url, "--credential", "nope"], env=env)
    assert missing.exit_code == 1 and "error (auth)" in missing.output and "fix the credential" in missing.output


def test_a_bmc_off_loopback_in_clear_is_refused_unless_allowed(tmp_path: Path) -> None:
    from gpucloud import bootstrap
    from gpucloud.config import Settings

    (tmp_path / "bmc_credentials").mkdir()
    (tmp_path / "bmc_credentials" / "ref").write_text("admin:secret")
    bmcs = bootstrap.bmcs(Settings(data_dir=tmp_path))
    for url in ("http://10.0.0.9", "http://bmc.example", "ftp://127.0.0.1"):
        with pytest.raises(BmcError, match=r"https://.*GPUCLOUD_BMC__ALLOW_INSECURE=true") as refused:
            bmcs.for_node(url, "1", "ref")
        assert refused.value.kind == "bad_request" and not refused.value.retryable
        with pytest.raises(BmcError, match="GPUCLOUD_BMC__ALLOW_INSECURE"):
            bmcs.discover(url, "ref")
    assert bmcs.for_node("https://10.0.0.9", "1", "ref").endpoint.url == "https://10.0.0.9"
    assert bmcs.for_node("http://127.0.0.1:8600", "1", "ref").endpoint.password == "secret"
    trusted = bootstrap.bmcs(Settings(data_dir=tmp_path, bmc={"allow_insecure": True}))
    assert trusted.for_node("http://10.0.0.9", "1", "ref").endpoint.url == "http://10.0.0.9"


def test_boot_from_image_inserts_virtual_media_and_a_one_time_override(emulator: BmcEmulator, tmp_path: Path) -> None:
    (tmp_path / "clean.iso").write_bytes(b"known image")
    with FileServer(str(tmp_path)) as images, FaultyProxy(emulator.url) as proxy:
        bmc = _bmc(emulator, "gpu-b", url=proxy.url)
        answer = bmc.boot_from_image(images.url("clean.iso"))
        assert answer == f"{images.url('clean.iso')} inserted in Cd; boot override Cd (Continuous)"
        # Read back from the emulator itself: the CD holds the image and the system boots it.
        cd = httpx.get(
            f"{emulator.url}/redfish/v1/Systems/{system_id_of('gpu-b')}/VirtualMedia/Cd",
            auth=(USERNAME, sim_bmc_password(emulator.data_dir)),
        ).json()
        assert (cd["Image"], cd["Inserted"]) == (images.url("clean.iso"), True)
        patches = [json.loads(body)["Boot"] for method, path, body in proxy.bodies if method == "PATCH"]
        # The emulator shows every override as Continuous; what was asked for is one boot.
        assert [(p["BootSourceOverrideTarget"], p["BootSourceOverrideEnabled"]) for p in patches] == [("Cd", "Once")]
        assert (
            "POST",
            f"/redfish/v1/Systems/{system_id_of('gpu-b')}/VirtualMedia/Cd/Actions/VirtualMedia.InsertMedia",
        ) in proxy.requests
        assert bmc.eject_image() == "Cd ejected" and bmc.eject_image() == "Cd was empty"

        proxy.mode = "no_virtual_media"
        with pytest.raises(BmcError) as refused:
            bmc.boot_from_image(images.url("clean.iso"))
        assert refused.value.kind == "unsupported" and "no virtual media" in str(refused.value)
        proxy.mode = "pass"
        with pytest.raises(BmcError) as missing:  # the emulator cannot fetch the image: refused
            bmc.boot_from_image(images.url("missing.iso"))
        assert missing.value.kind == "unsupported" and "cannot boot the image" in str(missing.value)
