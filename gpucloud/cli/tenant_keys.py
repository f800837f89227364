"""This user's keys for a tenant's weights: the signing key its pushes and reported evaluations
are signed with, and the keys its pulls trust. They live in the CLI's per-user config folder
(beside `config.yaml`: `$GPUCLOUD_CONFIG`'s folder, else `$XDG_CONFIG_HOME/gpucloud`, else
`~/.config/gpucloud`), as `signing-keys/<tenant id>.ed25519` and `trusted-keys/<tenant id>`, so a
pull works from any directory and the CLI never writes into the one it runs from.

Earlier releases kept them in the data dir of the current directory (`./.data`, or
`$GPUCLOUD_DATA_DIR`). Keys found there are still used, read-only (a signing key only while the
config folder has none), and each use says the command that moves them into the config folder;
nothing is written there.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from nacl.signing import VerifyKey
from rich.markup import escape

from gpucloud.cli import contexts
from gpucloud.cli.common import err
from gpucloud.client.registry import signer_for, trust_key, trusted_keys
from gpucloud.registry.manifest import Signer

SIGNING_KEYS, TRUSTED_KEYS = "signing-keys", "trusted-keys"


def keys_dir() -> Path:
    """The folder that holds this user's `signing-keys/` and `trusted-keys/`."""
    return contexts.config_path().parent


def legacy_dir() -> Path:
    """Where earlier releases kept them: the data dir, relative to the current directory."""
    return Path(os.environ.get(contexts.DATA_DIR_ENV) or ".data").absolute()


def signing_key_path(tenant_id: str, base: Path | None = None) -> Path:
    return (base or keys_dir()) / SIGNING_KEYS / f"{tenant_id}.ed25519"


def signer(tenant_id: str) -> Signer:
    """The tenant's signing key on this machine, created (0600, in a 0700 folder) on first use;
    one left in the old place is used where none is in the new one, with the command to move it."""
    key = signing_key_path(tenant_id)
    old = signing_key_path(tenant_id, legacy_dir())
    if not key.exists() and old.exists():
        _say_move(old, move_command(old, key.parent))
        return signer_for(legacy_dir(), tenant_id)
    _private_folder(keys_dir())
    return signer_for(keys_dir(), tenant_id)


def trusted(tenant_id: str) -> list[VerifyKey]:
    """The keys this machine trusts for the tenant's versions (`client.registry.trusted_keys`),
    and any still in the old place (each with what moves it: trust is only ever added to)."""
    keys = trusted_keys(keys_dir(), tenant_id)
    old_base = legacy_dir()
    if old_base == keys_dir():
        return keys
    old_key, new_key = signing_key_path(tenant_id, old_base), signing_key_path(tenant_id)
    old_ring, new_ring = old_base / TRUSTED_KEYS / tenant_id, keys_dir() / TRUSTED_KEYS / tenant_id
    if old_key.exists():
        if new_key.exists():  # this user signs with the new one: the old one stays trusted until moved away
            public = bytes(signer_for(old_base, tenant_id).verify_key).hex()
            _say_move(old_key, f"gpucloud weights trust {public} && rm {shlex.quote(str(old_key))}")
        else:
            _say_move(old_key, move_command(old_key, new_key.parent))
    if old_ring.exists():
        if new_ring.exists():
            quoted = shlex.quote(str(old_ring))
            _say_move(old_ring, f"cat {quoted} >> {shlex.quote(str(new_ring))} && rm {quoted}")
        else:
            _say_move(old_ring, move_command(old_ring, new_ring.parent))
    return keys + [key for key in trusted_keys(old_base, tenant_id) if key not in keys]


def trust(tenant_id: str, public_key_hex: str, label: str = "") -> str:
    """Trust a public key for the tenant's versions on this machine; its key id."""
    _private_folder(keys_dir())
    return trust_key(keys_dir(), tenant_id, public_key_hex, label)


def move_command(old: Path, folder: Path) -> str:
    return f"mkdir -p -m 700 {shlex.quote(str(folder))} && mv {shlex.quote(str(old))} {shlex.quote(str(folder))}/"


def _say_move(old: Path, command: str) -> None:
    err.print(
        f"[yellow]warning:[/] using {escape(str(old))}, where earlier releases kept keys (the data dir of the "
        f"directory you run from); this CLI keeps them in {escape(str(keys_dir()))}, whichever directory you "
        f"run from. Move it: {escape(command)}",
        highlight=False,
    )


def _private_folder(path: Path) -> None:
    """The config folder, made 0700 if the CLI makes it (as `contexts.save` does)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
