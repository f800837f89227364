"""The simulated managers' shared state (kept in memory, and in a JSON file when given one), the
refusal every manager answers a broken constraint with, and what every handler depends on."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, NoReturn, TypeVar

from fastapi import Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict

from gpucloud.fabric.interface import (
    DEFAULT_PKEY,
    Membership,
    NvlPartition,
    PKey,
    Vpc,
)

GUID = re.compile(r"^0x[0-9a-f]{16}$")


def refuse(status_code: int, constraint: str, message: str) -> NoReturn:
    raise HTTPException(status_code, detail={"constraint": constraint, "message": message})


K = TypeVar("K")
V = TypeVar("V")
R = TypeVar("R", bound=BaseModel)


def existing(records: dict[K, V], key: K, constraint: str, message: str) -> V:
    """The record under `key`, or the manager's 404 naming the constraint."""
    if key not in records:
        refuse(404, constraint, message)
    return records[key]


def parse_pkey(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        refuse(422, "pkey_format", f"pkey {text!r} is not a hex number like 0x0a12")


def pkey_hex(pkey: int) -> str:
    return f"0x{pkey:04x}"


@dataclass
class FabricState:
    """What the three managers hold; every access goes through `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pkeys: dict[int, dict[str, Membership]] = field(default_factory=lambda: {DEFAULT_PKEY: {}})
    pkey_names: dict[int, str] = field(default_factory=lambda: {DEFAULT_PKEY: "default"})
    domain_of_gpu: dict[str, str] = field(default_factory=dict)
    partitions: dict[int, NvlPartition] = field(default_factory=dict)
    next_partition_id: int = 1
    vpcs: dict[int, Vpc] = field(default_factory=dict)
    fault: str | None = None
    state_path: Path | None = None

    # Each pkey's members as JSON, kept until the pkey changes: the default partition
    # holds every port of the fleet, and re-encoding it after every change made each write, and
    # each read of it, cost as much as the whole fleet.
    _pkey_json: dict[int, str] = field(default_factory=dict)

    def members_json(self, pkey: int) -> str:
        """The pkey's members as a JSON list of `{"guid", "membership"}`, sorted by GUID."""
        if (cached := self._pkey_json.get(pkey)) is None:
            members = [{"guid": g, "membership": m.value} for g, m in sorted(self.pkeys[pkey].items())]
            cached = self._pkey_json[pkey] = json.dumps(members)
        return cached

    def read(self, find: Callable[[], R], members: str) -> R:
        """What a single-record read answers (`find` runs under the lock): under the `stale_reads`
        fault, the record with its `members` left out, as a manager answering from a lagging
        replica would."""
        with self.lock:
            record = find()
        return record.model_copy(update={members: ()}) if self.fault == "stale_reads" else record

    def saved(self, *, pkeys: Iterable[int] = ()) -> None:
        """Write the state to `state_path` (when there is one); call with `lock` held, after a
        change, naming the pkeys it changed (their JSON is encoded afresh, the rest reused)."""
        for pkey in pkeys:
            self._pkey_json.pop(pkey, None)
        if self.state_path is None:
            return
        rest = {
            "domain_of_gpu": self.domain_of_gpu,
            "partitions": [p.model_dump(mode="json") for p in self.partitions.values()],
            "next_partition_id": self.next_partition_id,
            "vpcs": [v.model_dump(mode="json") for v in self.vpcs.values()],
        }
        encoded = ", ".join(
            f'{{"pkey": {p}, "name": {json.dumps(self.pkey_names[p])}, "members": {self.members_json(p)}}}'
            for p in sorted(self.pkeys)
        )
        partial = self.state_path.with_suffix(".partial")
        partial.write_text(f'{{"pkeys": [{encoded}], {json.dumps(rest)[1:]}')
        os.replace(partial, self.state_path)

    @classmethod
    def load(cls, state_path: Path | None) -> FabricState:
        state = cls(state_path=state_path)
        if state_path is None or not state_path.exists():
            return state
        body = json.loads(state_path.read_text())
        for record in map(PKey.model_validate, body["pkeys"]):
            state.pkeys[record.pkey] = {m.guid: m.membership for m in record.members}
            state.pkey_names[record.pkey] = record.name
        state.domain_of_gpu = body["domain_of_gpu"]
        state.partitions = {p.partition_id: p for p in map(NvlPartition.model_validate, body["partitions"])}
        state.next_partition_id = body["next_partition_id"]
        state.vpcs = {v.vni: v for v in map(Vpc.model_validate, body["vpcs"])}
        return state


async def fabric_state(request: Request) -> FabricState:
    return request.app.state.fabric


StateDep = Annotated[FabricState, Depends(fabric_state)]


async def available(state: StateDep) -> None:
    if state.fault == "unavailable":
        raise HTTPException(503, detail="injected fault: the manager is unavailable")


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
