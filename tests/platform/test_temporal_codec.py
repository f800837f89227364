"""Temporal payloads are sealed (`adapters/temporal.py`): AES-GCM with the newest key, each
payload naming its key so a rotation keeps old payloads readable; the codec server opens them
for admins only (`entrypoints/codec_server.py`)."""

from __future__ import annotations

import base64
import json
import stat
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from gpucloud.adapters.temporal import KEY_ID, CodecKeys, EncryptionCodec, add_codec_key, data_converter, new_codec_key
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.entrypoints.codec_server import create_app
from gpucloud.models.operator_roles import Role
from gpucloud.services import operators, tenants

pytestmark = pytest.mark.unit

SECRET_ENV = {"HF_TOKEN": "hf_very_secret_value"}


async def _sealed(codec: EncryptionCodec, value: object):
    converter = data_converter(codec.keys)
    (payload,) = converter.payload_converter.to_payloads([value])
    (sealed,) = await codec.encode([payload])
    return sealed


async def test_a_payload_is_sealed_and_opens_with_its_key():
    codec = EncryptionCodec(CodecKeys.parse(new_codec_key()))
    sealed = await _sealed(codec, SECRET_ENV)
    assert b"hf_very_secret_value" not in sealed.SerializeToString()
    assert sealed.metadata["encoding"] == b"binary/encrypted"
    (opened,) = await codec.decode([sealed])
    assert json.loads(opened.data) == SECRET_ENV
    # A payload relabelled to another key, or tampered with, is refused, never misread.
    tampered = type(sealed)()
    tampered.CopyFrom(sealed)
    tampered.data = sealed.data[:-1] + bytes([sealed.data[-1] ^ 1])
    with pytest.raises(ValueError, match="integrity"):
        await codec.decode([tampered])


async def test_rotation_keeps_old_payloads_readable_and_seals_new_ones_with_the_newest_key(tmp_path):
    path = tmp_path / "temporal_codec_keys"
    settings = Settings(data_dir=tmp_path)
    first = CodecKeys.parse(settings.temporal_codec_keys)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    old = await _sealed(EncryptionCodec(first), SECRET_ENV)

    second_id = add_codec_key(path)
    rotated = CodecKeys.parse(Settings(data_dir=tmp_path).temporal_codec_keys)
    assert list(rotated.keys) == [first.active, second_id] and rotated.active == second_id
    codec = EncryptionCodec(rotated)
    (opened,) = await codec.decode([old])
    assert json.loads(opened.data) == SECRET_ENV
    new = await _sealed(codec, SECRET_ENV)
    assert new.metadata[KEY_ID].decode() == second_id
    # A process that has only the old key cannot open the new payload: it says which key it lacks.
    with pytest.raises(ValueError, match=second_id):
        await EncryptionCodec(first).decode([new])


async def test_a_payload_recorded_before_the_codec_reads_as_it_is():
    codec = EncryptionCodec(CodecKeys.parse(new_codec_key()))
    (plain,) = data_converter(codec.keys).payload_converter.to_payloads([SECRET_ENV])
    assert await codec.decode([plain]) == [plain]


@pytest.mark.parametrize("bad", ["", "not base64!", base64.b64encode(b"short").decode()])
def test_a_key_that_is_not_32_bytes_is_refused(bad):
    with pytest.raises(ValueError, match="GPUCLOUD_TEMPORAL__CODEC_KEYS"):
        CodecKeys.parse(bad)


@pytest.mark.one_database
async def test_the_codec_server_decodes_for_admins_only(db_url):
    """Operators' tokens are looked up as the API looks them up: the bootstrap admin and a named
    admin may decode; a fleet operator's or read-only token is 403 (payloads hold tenants'
    secrets); a tenant's key, a made-up token and no token are 401."""
    codec = EncryptionCodec(CodecKeys.parse(new_codec_key()))
    sealed = await _sealed(codec, SECRET_ENV)
    body = json_format.MessageToJson(Payloads(payloads=[sealed]))
    with session_scope(db_url) as session:
        tokens = {
            role: operators.create(session, f"op-{role.value}", role, created_by="test", lifetime=timedelta(days=1))[2]
            for role in (Role.ADMIN, Role.FLEET, Role.READ_ONLY)
        }
        _, _, _, tenant_key = tenants.create(session, name="acme", quotas=[], actor="operator:test")
    app = create_app(codec, database_url=db_url, operator_token="op-token", ui_origin="http://127.0.0.1:8233")
    with TestClient(app) as client:
        for headers in ({}, {"Authorization": f"Bearer {tenant_key}"}, {"Authorization": "Bearer made-up"}):
            refused = client.post("/decode", content=body, headers=headers)
            assert refused.status_code == 401 and "hf_very_secret_value" not in refused.text
        for role in (Role.FLEET, Role.READ_ONLY):
            refused = client.post("/decode", content=body, headers={"Authorization": f"Bearer {tokens[role]}"})
            assert refused.status_code == 403 and "hf_very_secret_value" not in refused.text
        for token in ("op-token", tokens[Role.ADMIN]):
            answer = client.post("/decode", content=body, headers={"Authorization": f"Bearer {token}"})
            assert answer.status_code == 200, answer.text
            (opened,) = json_format.ParseDict(answer.json(), Payloads()).payloads
            assert json.loads(opened.data) == SECRET_ENV
        garbage = client.post("/decode", content=b"{", headers={"Authorization": "Bearer op-token"})
        assert garbage.status_code == 400
        # The Web UI's browser may ask first; only its own origin is allowed.
        preflight = {"Origin": "http://127.0.0.1:8233", "Access-Control-Request-Method": "POST"}
        assert client.options("/decode", headers=preflight).status_code == 200
        assert client.options("/decode", headers={**preflight, "Origin": "http://evil"}).status_code == 400
