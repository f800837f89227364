"""Run a shipped systemd unit the way systemd would, on a host whose file system is a folder.

`Unit` reads a `.service` file by systemd's syntax (line continuations, comments, `%i`), merges
its environment by systemd.exec(5)'s rules (Environment= lines in order, then EnvironmentFile=
files in order, which override them; a `-` prefix makes a file optional) and expands `${VAR}`
in ExecStart= from that environment. `Host` maps the absolute paths the units and the
environment file name (`/opt/gpucloud`, `/etc/gpucloud`, `/var/lib/gpucloud`) into one test
folder, and `/opt/gpucloud/bin/gpucloud` to the `gpucloud` this test runs, so the units' own
lines run unedited.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
MAPPED = ("/opt/gpucloud", "/etc/gpucloud", "/var/lib/gpucloud", "/etc/systemd")


def read_env_file(path: Path) -> dict[str, str]:
    """An EnvironmentFile=: `KEY=VALUE` lines, `#`/`;` comments, quotes around a value dropped."""
    assigned: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        name, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}: not an assignment: {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        assigned[name.strip()] = value
    return assigned


@dataclass
class Host:
    """A host's file system under `root`: what the guide installs goes where it says, mapped."""

    root: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def path(self, absolute: str) -> Path:
        """Where `absolute` (one of the mapped prefixes) lies on this host."""
        if absolute.startswith("/opt/gpucloud/bin/"):
            return Path(sys.executable).parent / absolute.removeprefix("/opt/gpucloud/bin/")
        if not absolute.startswith(MAPPED):
            raise ValueError(f"{absolute} is outside what this host maps ({', '.join(MAPPED)})")
        return self.root / absolute.lstrip("/")

    def mapped(self, text: str) -> str:
        """`text` with every mapped absolute path in it rewritten to this host's."""
        pattern = "|".join(re.escape(p) for p in MAPPED)
        return re.sub(rf"(?:{pattern})[^\s:,\"'()]*", lambda m: str(self.path(m.group(0))), text)

    def install(self, source: Path, absolute: str, mode: int = 0o644) -> Path:
        target = self.path(absolute)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        target.chmod(mode)
        return target

    def unit(self, name: str) -> Unit:
        template, _, instance = name.partition("@")
        file = UNITS / (f"{template}@.service" if instance else f"{template}.service")
        return Unit(self, file, instance.removesuffix(".service"))

    def start(self, name: str, *, log_dir: Path) -> subprocess.Popen:
        """Start the unit's ExecStart= as systemd would (its environment only, none of ours but
        PATH and the Python this test runs), logging to `log_dir/<name>.log`."""
        unit = self.unit(name)
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                unit.argv(), env=unit.environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.processes[name] = proc
        return proc

    def run(self, name: str, *, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """A oneshot unit: run its ExecStart= to the end, its output captured."""
        unit = self.unit(name)
        return subprocess.run(unit.argv(), env=unit.environment(), capture_output=True, text=True, timeout=timeout_s)

    def systemctl(self, words: list[str], *, log_dir: Path, timeout_s: float = 180) -> dict[str, str]:
        """`systemctl start|enable --now UNIT...` as the guide writes it: a oneshot unit runs to
        its end (its output returned by unit; a failure raises), the others start."""
        verb, *rest = words[1:]
        units = [word.removesuffix(".service") for word in rest if not word.startswith("-")]
        if verb not in ("start", "enable") or (verb == "enable" and "--now" not in rest) or not units:
            raise ValueError(f"not a start: {' '.join(words)}")
        outputs = {}
        for name in units:
            if dict(self.unit(name).directives()).get("Type") == "oneshot":
                done = self.run(name, timeout_s=timeout_s)
                outputs[name] = done.stdout + done.stderr
                if done.returncode != 0:
                    raise AssertionError(f"{name} exited {done.returncode}:\n{outputs[name][-3000:]}")
            else:
                self.start(name, log_dir=log_dir)
        return outputs

    def stop_all(self, timeout_s: float = 20.0) -> None:
        for proc in reversed(list(self.processes.values())):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes.values():
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class Unit:
    host: Host
    file: Path
    instance: str = ""

    def directives(self) -> list[tuple[str, str]]:
        """The [Service] section's directives in order (continuations joined, `%i` expanded)."""
        text = self.file.read_text().replace("\\\n", " ").replace("%i", self.instance).replace("%%", "%")
        section, found = "", []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line
                continue
            if section == "[Service]":
                key, _, value = line.partition("=")
                found.append((key.strip(), value.strip()))
        return found

    def environment(self) -> dict[str, str]:
        """systemd.exec(5): Environment= in order, then each EnvironmentFile= in order, which
        overrides Environment= wherever it stands; a missing file is an error unless `-`."""
        env: dict[str, str] = {}
        for key, value in self.directives():
            if key == "Environment":
                env |= dict(word.split("=", 1) for word in shlex.split(value))
        for key, value in self.directives():
            if key == "EnvironmentFile":
                optional, absolute = value.startswith("-"), value.removeprefix("-")
                path = self.host.path(absolute)
                if path.exists():
                    env |= read_env_file(path)
                elif not optional:
                    raise FileNotFoundError(f"{self.file.name}: EnvironmentFile={absolute} does not exist")
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        return base | {k: self.host.mapped(v) for k, v in env.items()}

    def argv(self) -> list[str]:
        """ExecStart= split as systemd does, `${VAR}` taken from the unit's environment."""
        lines = [value for key, value in self.directives() if key == "ExecStart"]
        if len(lines) != 1:
            raise ValueError(f"{self.file.name} has {len(lines)} ExecStart= lines")
        env = self.environment()

        def expand(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in env:
                raise KeyError(f"{self.file.name}: ExecStart= uses ${{{name}}}, which its environment does not set")
            return env[name]

        words = [re.sub(r"\$\{(\w+)\}", expand, word) for word in shlex.split(lines[0].lstrip("-@+!"))]
        return [self.host.mapped(word) if word.startswith("/") else word for word in words]
