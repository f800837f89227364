"""Child processes that die with the process that started them.

A parent that dies by SIGKILL (or the OOM killer) runs no `finally` and stops nothing: without
this, its children run on orphaned. An API master killed that way left its uvicorn workers
serving its port with the old code, so the restarted API could not bind. Linux's
`PR_SET_PDEATHSIG` has the kernel signal a child when its parent dies, however it dies; every
child the project starts asks for it, in one of two ways:

- a child we start ourselves: `popen_kwargs()` (or `dies_with_this_process()` as `preexec_fn`),
  which asks for it in the child between fork and exec (it survives the exec);
- a Python child another library starts (uvicorn's workers, through multiprocessing):
  `die_with_parent(pid)` early in the child.

Each also checks, once the signal is asked for, that the parent is still the one that started it:
a parent that died before the request leaves nothing to send the signal, so the child stops
itself. The signal is SIGTERM, so each child shuts down as it would on `kill` (a worker drains,
uvicorn closes its port).

The kernel sends the signal when the *thread* that started the child ends, not only the process:
start children from a thread that lives as long as they should (the main thread, or one that waits
for them).

The exceptions are on a node, and on purpose: a workload and its log pump outlive an agent's
restart (`agent/workloads.py`), and the commands the agent runs to change the node (the
container runtime's, the wipe tools) finish what they began, each bounded in time, for the
restarted agent to find; only the agent's readers of a container's logs die with it.

Elsewhere than Linux these do nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from functools import cache
from typing import Any

PR_SET_PDEATHSIG = 1


@cache
def _prctl() -> Callable[..., int] | None:
    """libc's `prctl`, loaded in the parent: a child between fork and exec should not load a
    library (another thread of the parent may have held the loader's lock when it forked)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    return prctl


def dies_with_this_process(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen` (or `asyncio.create_subprocess_exec`): the child gets
    `sig` when this process (the thread that starts it) dies."""
    parent, prctl = os.getpid(), _prctl()

    def preexec() -> None:
        if prctl is None:
            return
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # died between the fork and the request: nobody will signal
            os._exit(128 + int(sig))

    return preexec


def popen_kwargs(sig: signal.Signals = signal.SIGTERM) -> dict[str, Any]:
    """The keyword arguments of `subprocess.Popen` that make the child die with this process."""
    return {"preexec_fn": dies_with_this_process(sig)}


def die_with_parent(parent: int, sig: signal.Signals = signal.SIGTERM) -> None:
    """In a child another library started: get `sig` when the process `parent` (the one that
    started this one) dies; if it already has, exit now (SystemExit, so uvicorn and the like
    shut down as on any exit)."""
    prctl = _prctl()
    if prctl is None:
        return
    if prctl(PR_SET_PDEATHSIG, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        raise SystemExit(f"the process that started this one ({parent}) is gone: exiting with it")


def die_with_multiprocessing_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """`die_with_parent` for a process multiprocessing started (as uvicorn starts its workers):
    its parent's pid is the one multiprocessing recorded when it created this process (not
    `os.getppid()`, which is already another if the parent died first). No-op elsewhere."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        die_with_parent(parent.pid, sig)
