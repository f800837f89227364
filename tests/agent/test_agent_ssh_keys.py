"""Issue 40: the real agent writes the workload's SSH keys to the login user's authorized_keys at
provision and removes the file at release and wipe (ending the login user's sessions), never
through a link the tenant planted; a key that is not one public key on one line is refused where
the workload is described."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState
from gpucloud.agent.ssh_keys import AuthorizedKeys, KeysNotWritten
from gpucloud.protocol.actions import ActionRequest, Workload
from gpucloud.sim.probe import SimulatedProbe
from support.agents import GpuResetOnly

pytestmark = pytest.mark.unit

KEY_A = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA tenant@laptop"
KEY_B = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTY= ci@runner"


def test_install_writes_exactly_the_keys_privately_and_remove_takes_the_file(tmp_path):
    path = tmp_path / "home" / ".ssh" / "authorized_keys"
    keys = AuthorizedKeys("tenant", path=path)
    assert keys.install([KEY_A, "  " + KEY_B + "\n"]) == path
    assert path.read_text() == f"{KEY_A}\n{KEY_B}\n"
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    keys.install([KEY_B])  # a provision for the next workload: its keys only
    assert path.read_text() == f"{KEY_B}\n"
    with path.open("a") as added:  # the tenant let a key of its own in
        added.write("ssh-rsa AAAAB3NzaC1yc2E= mine\n")
    keys.remove()
    assert not path.exists() and list(path.parent.iterdir()) == []
    keys.remove()  # nothing left: still fine
    keys.install([])  # a workload without keys lets nobody in
    assert not path.exists()


def test_links_the_tenant_planted_are_never_followed(tmp_path):
    victim_dir = tmp_path / "root" / ".ssh"
    victim_dir.mkdir(parents=True)
    victim = victim_dir / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA operator\n")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".ssh").symlink_to(victim_dir)  # ~/.ssh -> root's
    keys = AuthorizedKeys("tenant", path=home / ".ssh" / "authorized_keys")
    with pytest.raises(KeysNotWritten, match="symbolic link"):
        keys.install([KEY_A])
    with pytest.raises(KeysNotWritten, match="symbolic link"):
        keys.remove()
    assert victim.read_text() == "ssh-ed25519 AAAA operator\n"

    (home / ".ssh").unlink()
    (home / ".ssh").mkdir()
    (home / ".ssh" / "authorized_keys").symlink_to(victim)  # the file itself -> root's
    keys.install([KEY_A])  # replaces the link, not what it points at
    assert not (home / ".ssh" / "authorized_keys").is_symlink()
    (home / ".ssh" / "authorized_keys").unlink()
    (home / ".ssh" / "authorized_keys").symlink_to(victim)
    keys.remove()  # removes the link
    assert not os.path.lexists(home / ".ssh" / "authorized_keys")
    assert victim.read_text() == "ssh-ed25519 AAAA operator\n"


def _agent(tmp_path: Path, keys: AuthorizedKeys | None) -> Agent:
    state = HostState(node_id="gpu-1", boot_id="boot-1", scratch_dir=tmp_path / "scratch")
    return Agent(state, SimulatedProbe("gpu-1", gpu_count=8), runner=GpuResetOnly(), ssh_keys=keys)


def _provision(agent: Agent, keys: list[str]) -> tuple[int, dict]:
    workload = Workload(command=["true"], ssh_keys=keys)
    request = ActionRequest(request_id="p1", tenant_id="t1", allocation_id="a1", workload=workload)
    return asyncio.run(agent.act("provision", request))


def test_a_node_without_the_login_user_refuses_a_workload_with_keys_only(tmp_path):
    agent = _agent(tmp_path, AuthorizedKeys("no-such-user-gpucloud"))
    status, body = _provision(agent, [KEY_A])
    assert status == 422 and "no user 'no-such-user-gpucloud'" in body["detail"] and "--ssh-user" in body["detail"]
    # Without keys there is nothing to write, and a release has nothing to remove.
    request = ActionRequest(request_id="p2", tenant_id="t1", allocation_id="a1")
    assert asyncio.run(agent.act("provision", request))[0] == 200
    assert asyncio.run(agent.act("release", ActionRequest(request_id="r1")))[0] == 200
    status, body = _provision(_agent(tmp_path, None), [KEY_A])
    assert status == 501 and "login user" in body["detail"]


@pytest.mark.parametrize(
    "key",
    [
        "-----BEGIN OPENSSH PRIVATE KEY-----",
        'command="rm -rf /" ' + KEY_A,
        KEY_A + "\nssh-rsa AAAAB3NzaC1yc2E= second",
        "ssh-dss AAAAB3NzaC1kc3M= old",
    ],
)
def test_a_key_that_is_not_one_public_key_line_is_refused(key):
    with pytest.raises(ValidationError, match=r"ssh_keys\[1\] is not an OpenSSH public key"):
        Workload(command=["true"], ssh_keys=[KEY_A, key])


class _TenantUser(AuthorizedKeys):
    """The login user as a uid nobody else on this machine has (no passwd entry needed)."""

    UID = 54321

    def _owner(self) -> tuple[int, int] | None:
        return self.UID, self.UID


@pytest.mark.skipif(os.geteuid() != 0, reason="only root kills another user's processes")
def test_removal_ends_the_login_users_sessions_and_spares_everyone_else(tmp_path):
    session = subprocess.Popen(["sleep", "300"], user=_TenantUser.UID, group=_TenantUser.UID)
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        keys = _TenantUser("tenant", path=tmp_path / "home" / ".ssh" / "authorized_keys")
        assert keys.end_sessions() == [session.pid]
        assert session.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None
    finally:
        for process in (session, bystander):
            process.kill()
            process.wait()
    assert AuthorizedKeys("root", path=tmp_path / "k").end_sessions() == []  # never root's processes
