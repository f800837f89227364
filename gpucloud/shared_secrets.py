"""The secrets several processes of a deployment share, each made where it is missing
(`gpucloud prepare`) or read from the settings: one table, which `prepare` walks and the
evaluation worker checks it holds none of (`workers/evaluation.platform_secrets_in`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from pydantic import SecretStr

from gpucloud.config import Settings


@dataclass(frozen=True)
class SharedSecret:
    name: str
    variable: str
    configured: Callable[[Settings], SecretStr | Path | None]
    path: Callable[[Settings], Path]
    make: Callable[[Settings], object]  # the settings' own load-or-create of it


def _bootstrap() -> ModuleType:
    """`gpucloud.bootstrap`, imported when a secret is made (by `gpucloud prepare`), not when the
    table is read: the evaluation worker reads it and loads nothing of the control plane."""
    from gpucloud import bootstrap

    return bootstrap


PAYLOAD_KEYS = "Temporal payload keys"  # the one shared secret the evaluation worker holds
SHARED_SECRETS = (
    SharedSecret(
        # GPUCLOUD_AGENT__ISSUER_KEY names where the key lives (not the key): made there if missing.
        "issuer key",
        "GPUCLOUD_AGENT__ISSUER_KEY",
        lambda s: None,
        lambda s: s.issuer_key_path,
        lambda s: _bootstrap().token_issuer(s),
    ),
    SharedSecret(
        "operator token",
        "GPUCLOUD_API__OPERATOR_TOKEN",
        lambda s: s.api.operator_token,
        lambda s: s.data_dir / "operator_token",
        lambda s: s.operator_token,
    ),
    SharedSecret(
        "page token secret",
        "GPUCLOUD_API__PAGE_TOKEN_SECRET",
        lambda s: s.api.page_token_secret,
        lambda s: s.data_dir / "page_token_secret",
        lambda s: s.page_token_secret,
    ),
    SharedSecret(
        "agent credential secret",
        "GPUCLOUD_AGENT__CREDENTIAL_SECRET",
        lambda s: s.agent.credential_secret,
        lambda s: s.data_dir / "agent_credential_secret",
        lambda s: s.agent_credential_secret,
    ),
    SharedSecret(
        "storage master key",
        "GPUCLOUD_TENANTS__STORAGE_MASTER_KEY",
        lambda s: s.tenants.storage_master_key,
        lambda s: s.data_dir / "storage_master_key",
        lambda s: _bootstrap().storage_master_key(s),
    ),
    SharedSecret(
        PAYLOAD_KEYS,
        "GPUCLOUD_TEMPORAL__CODEC_KEYS",
        lambda s: s.temporal.codec_keys,
        lambda s: s.temporal_codec_keys_path,
        lambda s: s.temporal_codec_keys,
    ),
    SharedSecret(
        "evaluator key",
        "GPUCLOUD_REGISTRY__EVALUATOR_KEY",
        lambda s: s.registry.evaluator_key,
        lambda s: s.data_dir / "evaluator_key",
        lambda s: s.evaluator_seed,
    ),
    SharedSecret(
        "metrics token",
        "GPUCLOUD_TELEMETRY__METRICS_TOKEN",
        lambda s: s.telemetry.metrics_token,
        lambda s: s.data_dir / "metrics_token",
        lambda s: s.metrics_token,
    ),
)
