"""Simulated UFM (`/ufmRest/resources/pkeys`): InfiniBand partition keys and their members."""

from __future__ import annotations

import json
from collections.abc import Iterable

from fastapi import APIRouter, Response
from pydantic import Field

from gpucloud.fabric.interface import (
    DEFAULT_PKEY,
    MAX_PKEY,
    MIN_PKEY,
    Membership,
    PortMember,
)
from gpucloud.sim.fabric_managers.state import GUID, Body, FabricState, StateDep, parse_pkey, pkey_hex, refuse


class PKeyCreate(Body):
    pkey: str
    name: str = ""


class PKeyGuids(Body):
    pkey: str
    guids: list[str] = Field(min_length=1)
    membership: Membership = Membership.FULL


class UfmPKey(Body):
    pkey: str
    name: str
    guids: list[PortMember] = Field(default_factory=list, description="with `guids_data=true` only, on a list")


def _ufm_json(state: FabricState, pkey: int, *, members: bool = True) -> str:
    """The pkey as UFM answers it, encoded straight from the state's cached member list (a
    model per member made a read of the default partition cost as much as the fleet)."""
    guids = state.members_json(pkey) if members else "[]"
    return f'{{"pkey": "{pkey_hex(pkey)}", "name": {json.dumps(state.pkey_names[pkey])}, "guids": {guids}}}'


def _existing_pkey(state: FabricState, pkey: int) -> None:
    if pkey not in state.pkeys:
        refuse(404, "pkey_exists", f"pkey {pkey_hex(pkey)} does not exist")


def _check_guids(guids: Iterable[str]) -> list[str]:
    normalized = [g.lower() for g in guids]
    for guid in normalized:
        if not GUID.match(guid):
            refuse(422, "guid_format", f"port GUID {guid!r} is not 0x followed by 16 hex digits")
    return normalized


def _check_full_membership(state: FabricState, pkey: int, guids: list[str]) -> None:
    if pkey == DEFAULT_PKEY:
        refuse(
            409,
            "default_partition_limited",
            f"the default partition {pkey_hex(DEFAULT_PKEY)} holds ports as limited members only",
        )
    for guid in guids:
        for other, members in state.pkeys.items():
            if other not in (pkey, DEFAULT_PKEY) and members.get(guid) == Membership.FULL:
                refuse(
                    409,
                    "full_member_single_pkey",
                    f"port {guid} is already a full member of pkey {pkey_hex(other)}; "
                    "a port is a full member of at most one non-default pkey",
                )


ufm = APIRouter(prefix="/ufmRest/resources/pkeys", tags=["ufm"])


@ufm.post("/add", status_code=201, response_model=UfmPKey)
async def create_pkey(body: PKeyCreate, state: StateDep) -> UfmPKey:
    pkey = parse_pkey(body.pkey)
    if not MIN_PKEY <= pkey <= MAX_PKEY:
        refuse(
            422,
            "pkey_range",
            f"pkey {pkey_hex(pkey)} is outside {pkey_hex(MIN_PKEY)}-{pkey_hex(MAX_PKEY)}",
        )
    with state.lock:
        if pkey in state.pkeys:
            refuse(409, "pkey_unique", f"pkey {pkey_hex(pkey)} already exists")
        state.pkeys[pkey] = {}
        state.pkey_names[pkey] = body.name
        state.saved(pkeys=[pkey])
        return UfmPKey(pkey=pkey_hex(pkey), name=body.name, guids=[])


@ufm.post("", status_code=204)
async def add_guids(body: PKeyGuids, state: StateDep) -> None:
    """Add ports (UFM answers with no body); ports already members as asked change nothing."""
    pkey = parse_pkey(body.pkey)
    guids = _check_guids(body.guids)
    with state.lock:
        _existing_pkey(state, pkey)
        if body.membership == Membership.FULL:
            _check_full_membership(state, pkey, guids)
        members = state.pkeys[pkey]
        if changed := [g for g in guids if members.get(g) != body.membership]:
            members.update(dict.fromkeys(changed, body.membership))
            state.saved(pkeys=[pkey])


@ufm.get("", response_model=dict[str, UfmPKey])
async def list_pkeys(state: StateDep, guids_data: bool = False) -> Response:
    """Every pkey; its members only with `guids_data=true`, as UFM lists them."""
    with state.lock:
        body = ", ".join(f'"{pkey_hex(p)}": {_ufm_json(state, p, members=guids_data)}' for p in sorted(state.pkeys))
    return Response(f"{{{body}}}", media_type="application/json")


@ufm.get("/{pkey}", response_model=UfmPKey)
async def get_pkey(pkey: str, state: StateDep) -> Response:
    number = parse_pkey(pkey)
    with state.lock:
        _existing_pkey(state, number)
        # Under `stale_reads` a single read answers from a lagging replica: no members.
        return Response(_ufm_json(state, number, members=state.fault != "stale_reads"), media_type="application/json")


@ufm.delete("/{pkey}/guids/{guids}", status_code=204)
async def remove_guids(pkey: str, guids: str, state: StateDep) -> None:
    number = parse_pkey(pkey)
    removed = _check_guids(guids.split(","))
    with state.lock:
        _existing_pkey(state, number)
        members = state.pkeys[number]
        if gone := [g for g in removed if g in members]:
            for guid in gone:
                del members[guid]
            state.saved(pkeys=[number])


@ufm.delete("/{pkey}", status_code=204)
async def delete_pkey(pkey: str, state: StateDep) -> None:
    number = parse_pkey(pkey)
    if number == DEFAULT_PKEY:
        refuse(409, "default_partition_permanent", "the default partition cannot be deleted")
    with state.lock:
        _existing_pkey(state, number)
        del state.pkeys[number]
        del state.pkey_names[number]
        state.saved(pkeys=[number])
