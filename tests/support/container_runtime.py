"""A simulated container runtime with docker's CLI, for nodes' image workloads in tests.

It keeps docker's rules where the agent relies on them: a name is used by one container at a
time (125 and "Conflict" otherwise), an image it does not have fails the run (125, "Unable to
find image"), `inspect` of a container it does not have fails, `stop --time T` sends SIGTERM
to the container's PID 1 and SIGKILL after T seconds, `rm --force` kills and forgets, `ps`
lists what it has. A container is a PID namespace of its own (`unshare --pid --fork
--kill-child`): when its PID 1 dies, the kernel kills the rest. Every command line it was given
is appended to `calls.jsonl` in its state directory (`SIM_RUNTIME_DIR`); the images it has are
`SIM_RUNTIME_IMAGES` (comma-separated).

A run without `--detach` (an evaluation's `run --rm`) runs in the foreground: its output is the
container's, its exit code the container's, and `--rm` forgets it afterwards. `--volume
HOST:CONTAINER[:ro]` stands for a bind mount: the command runs in HOST when `--workdir` is
CONTAINER, and an `--env` value naming CONTAINER names HOST (no mount namespace without root);
`--network none` is recorded, not enforced.

A detached container's stdout and stderr go to `containers/<name>.log` (its log driver), which
`logs [--follow] [--tail N]` prints; `--log-opt` is recorded, not enforced.

`write_runtime(dir, images)` puts an executable `docker` for it in `dir` and returns its path.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path


def write_runtime(directory: Path, images: list[str]) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    runtime = directory / "docker"
    runtime.write_text(
        f"#!/bin/sh\nSIM_RUNTIME_DIR={directory} SIM_RUNTIME_IMAGES={','.join(images)} "
        f'exec {sys.executable} {Path(__file__).resolve()} "$@"\n'
    )
    runtime.chmod(0o755)
    return str(runtime)


def _init_of(pid: int) -> int | None:
    """The container's PID 1: unshare's child."""
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children = (task / "children").read_text().split()
            if children:
                return int(children[0])
    except OSError:
        pass
    return None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Runtime:
    def __init__(self) -> None:
        self.dir = Path(os.environ["SIM_RUNTIME_DIR"])
        self.images = set(filter(None, os.environ.get("SIM_RUNTIME_IMAGES", "").split(",")))

    def _record(self, name: str) -> Path:
        return self.dir / "containers" / f"{name}.json"

    def _load(self, name: str) -> dict | None:
        try:
            return json.loads(self._record(name).read_text())
        except OSError:
            return None

    def run(self, args: list[str]) -> int:
        options: dict[str, list[str]] = {}
        while args and args[0] != "--" and args[0].startswith("--"):
            flag = args.pop(0)
            options.setdefault(flag, []).append("" if flag in ("--detach", "--rm") else args.pop(0))
        if args and args[0] == "--":
            args.pop(0)
        image, command = args[0], args[1:]
        name = options["--name"][0]
        if self._load(name) is not None:
            print(f'Conflict. The container name "/{name}" is already in use', file=sys.stderr)
            return 125
        if image not in self.images:
            print(f"Unable to find image '{image}' locally: pull access denied", file=sys.stderr)
            return 125
        if "--detach" not in options:
            return self._foreground(name, options, command)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        for line in Path(options["--env-file"][0]).read_text().splitlines():
            key, _, value = line.partition("=")
            env[key] = value
        exit_file = self.dir / "containers" / f"{name}.exit"
        exit_file.parent.mkdir(parents=True, exist_ok=True)
        script = 'trap "" HUP; "$@"; echo $? > "$EXIT_FILE"'
        with open(self._output(name), "wb") as output:  # the log driver's file
            process = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", script, "sh", *command],
                env={**env, "EXIT_FILE": str(exit_file)},
                cwd="/",
                stdout=output,
                stderr=output,
                start_new_session=True,
            )
        deadline = time.monotonic() + 5
        while _init_of(process.pid) is None and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        container_id = secrets.token_hex(32)
        record = {"id": container_id, "pid": process.pid, "image": image, "exit_file": str(exit_file)}
        self._record(name).write_text(json.dumps(record))
        print(container_id)
        return 0

    def _foreground(self, name: str, options: dict[str, list[str]], command: list[str]) -> int:
        mounts = {}
        for volume in options.get("--volume", []):
            host, container = volume.split(":")[:2]
            mounts[container] = host
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        for pair in options.get("--env", []):
            key, _, value = pair.partition("=")
            env[key] = mounts.get(value, value)
        workdir = options.get("--workdir", ["/"])[0]
        self._record(name).parent.mkdir(parents=True, exist_ok=True)
        self._record(name).write_text(json.dumps({"id": secrets.token_hex(32), "pid": os.getpid(), "image": "-"}))
        try:
            return subprocess.call(command, env=env, cwd=mounts.get(workdir, workdir))
        finally:
            if "--rm" in options:
                self._record(name).unlink(missing_ok=True)

    def _output(self, name: str) -> Path:
        return self.dir / "containers" / f"{name}.log"

    def logs(self, args: list[str]) -> int:
        """`logs [--follow] [--tail N|all] NAME`: the container's output, then with --follow what
        it prints until it stops."""
        if (record := self._existing(args[-1])) is None:
            return 1
        tail = args[args.index("--tail") + 1] if "--tail" in args else "all"
        with open(self._output(args[-1]), "rb") as output:
            lines = output.read().splitlines(keepends=True)
            sys.stdout.buffer.write(b"".join(lines if tail == "all" else lines[len(lines) - int(tail) :]))
            sys.stdout.flush()
            while "--follow" in args:
                if data := output.read():
                    sys.stdout.buffer.write(data)
                    sys.stdout.flush()
                    continue
                init = _init_of(record["pid"])
                if init is None or not _alive(init):
                    sys.stdout.buffer.write(output.read())
                    return 0
                time.sleep(0.05)
        return 0

    def _existing(self, name: str, what: str = "container") -> dict | None:
        """The container's record; None, with docker's error on stderr, when there is none."""
        record = self._load(name)
        if record is None:
            print(f"Error: No such {what}: {name}", file=sys.stderr)
        return record

    def inspect(self, args: list[str]) -> int:
        if (record := self._existing(args[-1], "object")) is None:
            return 1
        init = _init_of(record["pid"])
        if init is not None and _alive(init):
            print(f"running 0 {init}")
            return 0
        exit_file = Path(record["exit_file"])
        code = exit_file.read_text().strip() if exit_file.exists() else "137"
        print(f"exited {code} 0")
        return 0

    def stop(self, args: list[str]) -> int:
        grace = float(args[args.index("--time") + 1]) if "--time" in args else 10.0
        if (record := self._existing(args[-1])) is None:
            return 1
        init = _init_of(record["pid"])
        if init is not None:
            os.kill(init, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while _alive(init) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(init):
                os.kill(init, signal.SIGKILL)
        print(args[-1])
        return 0

    def rm(self, args: list[str]) -> int:
        if (record := self._existing(args[-1])) is None:
            return 1
        init = _init_of(record["pid"])
        if init is not None:
            os.kill(init, signal.SIGKILL)
        self._record(args[-1]).unlink()
        print(args[-1])
        return 0

    def ps(self, args: list[str]) -> int:
        wanted = args[args.index("--filter") + 1].removeprefix("name=^").removesuffix("$")
        record = self._load(wanted)
        if record is not None:
            print(record["id"][:12])
        return 0


def main(argv: list[str]) -> int:
    runtime = Runtime()
    runtime.dir.mkdir(parents=True, exist_ok=True)
    with open(runtime.dir / "calls.jsonl", "a") as calls:
        calls.write(json.dumps(argv) + "\n")
    command, args = argv[0], argv[1:]
    return getattr(runtime, command)(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
