"""Each simulated node's SSH endpoint: a real SSH server on a loopback port of its own (asyncssh),
so a tenant's `ssh` (or `gpucloud allocations ssh`) reaches a node of a simulated allocation the
way it reaches a real one.

It lets in exactly the keys the current allocation's workload named: the action core installs
them at provision and removes them at release and wipe (`SimulatedHardware`), and the server
reads them at each login, so a key of a released allocation is refused at once, and the
sessions it had open are closed. Only the image's login user (`AgentSettings.ssh_user`) may log
in, only with a public key; no port forwarding of any kind (a forward would open the fleet
process's loopback, the control plane's services, to the tenant).

Why a restricted shell and not a real one: the simulated fleet runs in a process of the
devstack that holds platform secrets (the operator token, the control plane's keys, ledger
tokens; environment variables and files of the data dir), and tenant-written commands must never
run in a process that holds a platform secret. A shell in a child process with a scrubbed
environment would still run as the same Unix user, able to read the data dir's keys and tokens
and to call the control plane's loopback ports; hiding those takes user and mount namespaces,
which containers and CI machines often refuse. So a simulated node executes nothing: its shell
answers a fixed set of commands from the node's simulated state (`hostname`, `whoami`,
`nvidia-smi`, `echo`, `uname`, `true`, `false`, joined by `;` or `&&`), and refuses every
other with exit status 127, as a shell does a command it cannot find. A simulated node runs no
workload either (`SimulatedHardware.start_workload` only notes it): what SSH proves here is the
path and the keys, not the tenant's code.
"""

from __future__ import annotations

import logging
import shlex
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

with warnings.catch_warnings():
    # asyncssh still imports DSA, which cryptography deprecates; no simulated node offers it.
    warnings.filterwarnings("ignore", message=".*DSA is deprecated.*")
    import asyncssh

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Exit status of a command the restricted shell does not have (a shell's "command not found").
NOT_FOUND = 127
# Bounds on what one session may send the shell: a line, and the lines of an interactive session.
MAX_LINE = 4096
MAX_LINES = 1000
PROMPT = "$ "


class SshNode(Protocol):
    """What the key check and the shell read of a simulated node (`SimNode`): its keys as the
    action core left them, read at each login."""

    id: str
    hostname: str
    gpu_type: str
    gpu_count: int
    gpu_uids: list[str]
    ssh_keys: tuple[str, ...]


@dataclass
class _Node:
    login: SshNode
    connections: set[asyncssh.SSHServerConnection] = field(default_factory=set)
    acceptor: asyncssh.SSHAcceptor | None = None


def public_keys(lines: Iterable[str]) -> set[bytes]:
    """The keys of authorized_keys lines, as wire bytes; a line that is not a key is skipped (and
    logged), as sshd skips it."""
    keys = set()
    for line in lines:
        try:
            keys.add(asyncssh.import_public_key(line.strip()).public_data)
        except (asyncssh.KeyImportError, ValueError) as exc:
            log.warning("skipping an SSH key that does not parse (%s): %.40s", exc, line)
    return keys


class FleetSsh:
    """The SSH endpoints of a simulated fleet's nodes: one listener a node on `host`, each with a
    host key of its own. Each login checks the node's keys as they are then; `disconnect` closes
    the sessions open on a node (its keys were removed: release, wipe)."""

    def __init__(self, *, user: str, host: str = LOOPBACK) -> None:
        self.user, self.host = user, host
        self._nodes: dict[str, _Node] = {}

    async def start(self, nodes: Iterable[SshNode]) -> None:
        for login in nodes:
            node = self._nodes[login.id] = _Node(login)
            node.acceptor = await asyncssh.listen(
                self.host,
                0,
                server_host_keys=[asyncssh.generate_private_key("ssh-ed25519")],
                server_factory=self._server_for(node),
                process_factory=self._shell_for(node),
                encoding="utf-8",
                sftp_factory=None,
                allow_scp=False,
                agent_forwarding=False,
                x11_forwarding=False,
                login_timeout=30,
                keepalive_interval=30,
            )
        log.info("SSH endpoints of %d simulated nodes on %s", len(self._nodes), self.host)

    def port(self, node_id: str) -> int | None:
        node = self._nodes.get(node_id)
        return node.acceptor.get_port() if node is not None and node.acceptor is not None else None

    def disconnect(self, node_id: str) -> None:
        node = self._nodes.get(node_id)
        for conn in list(node.connections if node is not None else ()):
            conn.close()

    async def close(self) -> None:
        for node in self._nodes.values():
            for conn in list(node.connections):
                conn.close()
            if node.acceptor is not None:
                node.acceptor.close()
                await node.acceptor.wait_closed()

    def _server_for(self, node: _Node) -> Callable[[], asyncssh.SSHServer]:
        return lambda: _NodeServer(node, self.user)

    def _shell_for(self, node: _Node) -> Callable[[asyncssh.SSHServerProcess], object]:
        async def session(process: asyncssh.SSHServerProcess) -> None:
            shell = RestrictedShell(node.login, user=self.user)
            if process.command is not None:
                out, status = shell.run(process.command)
                process.stdout.write(out)
                process.exit(status)
                return
            await _interactive(process, shell)

        return session


class _NodeServer(asyncssh.SSHServer):
    """One connection to a node: public keys only, the login user only, the node's current keys
    only (read at the login, not at the listener's start), no forwarding."""

    def __init__(self, node: _Node, user: str) -> None:
        self.node, self.user = node, user
        self.conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.node.connections.discard(self.conn)

    def begin_auth(self, username: str) -> bool:
        return True  # every login authenticates

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        return username == self.user and key.public_data in public_keys(self.node.login.ssh_keys)

    def auth_completed(self) -> None:
        if self.conn is not None:
            self.node.connections.add(self.conn)

    # No forwarding: each would reach the fleet process's own network, loopback included.
    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int) -> bool:
        return False

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        return False

    def unix_connection_requested(self, dest_path: str) -> bool:
        return False

    def unix_server_requested(self, listen_path: str) -> bool:
        return False


async def _interactive(process: asyncssh.SSHServerProcess, shell: RestrictedShell) -> None:
    """A login without a command: a prompt, each line run, until `exit`, end of input or too many lines."""
    status = 0
    for _ in range(MAX_LINES):
        process.stdout.write(PROMPT)
        try:
            line = await process.stdin.readline()
        except (asyncssh.BreakReceived, asyncssh.SignalReceived, asyncssh.TerminalSizeChanged):
            continue
        except asyncssh.DisconnectError:
            return
        if not line:
            break
        if line.strip() in ("exit", "logout"):
            break
        out, status = shell.run(line[:MAX_LINE])
        process.stdout.write(out)
    process.exit(status)


class RestrictedShell:
    """The simulated node's shell: a fixed set of commands answered from the node's state,
    nothing executed (see the module's docstring for why)."""

    def __init__(self, login: SshNode, *, user: str) -> None:
        self.login, self.user = login, user

    def run(self, line: str) -> tuple[str, int]:
        """Run a command line: commands joined by `;` (each runs) or `&&` (the next runs if this
        one succeeded). Returns what it printed and the last exit status."""
        try:
            lexer = shlex.shlex(line[:MAX_LINE], posix=True, punctuation_chars=";&|<>")
            lexer.whitespace_split = True
            tokens = list(lexer)
        except ValueError as exc:
            return f"sim-shell: {exc}\n", 2
        out: list[str] = []
        command: list[str] = []
        status, skip = 0, False
        for token in [*tokens, ";"]:
            if token not in (";", "&&") and not set(token) <= set(";&|<>"):
                command.append(token)
                continue
            if token not in (";", "&&"):
                return "".join(out) + f"sim-shell: {token!r} is not supported on a simulated node\n", 2
            if command and not skip:
                text, status = self._one(command)
                out.append(text)
            skip = token == "&&" and status != 0
            command = []
        return "".join(out), status

    def _one(self, argv: list[str]) -> tuple[str, int]:
        name, args = argv[0], argv[1:]
        login = self.login
        if name == "hostname":
            return login.hostname + "\n", 0
        if name == "whoami":
            return self.user + "\n", 0
        if name == "echo":
            return " ".join(args) + "\n", 0
        if name == "true":
            return "", 0
        if name == "false":
            return "", 1
        if name == "uname":
            return ("Linux " + login.hostname + " simulated x86_64\n" if "-a" in args else "Linux\n"), 0
        if name == "nvidia-smi":
            uids = login.gpu_uids or [f"GPU-{login.id}-{i}" for i in range(login.gpu_count)]
            return "".join(f"GPU {i}: NVIDIA {login.gpu_type} (UUID: {uid})\n" for i, uid in enumerate(uids)), 0
        known = "hostname, whoami, nvidia-smi, echo, uname, true, false"
        return f"sim-shell: {name}: command not found (a simulated node answers only {known})\n", NOT_FOUND
