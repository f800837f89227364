"""Workflow histories as tests keep them: recorded histories are committed with their payloads
opened (the keys that sealed them live only as long as the test process), so they replay
anywhere; the codec reads an unsealed payload as it is."""

from __future__ import annotations

from pathlib import Path

from google.protobuf.message import Message
from temporalio.api.common.v1 import Payload
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from gpucloud.adapters.temporal import EncryptionCodec
from gpucloud.workers.main import WORKFLOWS

HISTORIES = Path(__file__).parent.parent / "histories"


def replayer(client, workflows=WORKFLOWS) -> Replayer:
    """A replayer with the client's own data converter (the codec included), checking what a
    replay is for (the commands the code gives for the recorded events) and not how long the code
    takes between yields: Temporal's deadlock detector fails an activation that holds the thread
    for 2 s, which a test process starved by its neighbours on two cores (or a garbage
    collection in the activation) can do: the replay fails, and once in a whole run its replayer
    never returned, so the test and its event loop's teardown each hung until pytest-timeout
    (300 s twice). `debug_mode` turns that detector off; the workers that run workflows keep it."""
    return Replayer(workflows=workflows, data_converter=client.data_converter, debug_mode=True)


def _open_payloads(message: Message, codec: EncryptionCodec) -> None:
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        # protobuf 7 dropped `label` for `is_repeated`
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
        if repeated and field.message_type.GetOptions().map_entry:
            items = list(value.values()) if field.message_type.fields_by_name["value"].message_type else []
        elif repeated:
            items = list(value)
        else:
            items = [value]
        for item in items:
            if isinstance(item, Payload):
                item.CopyFrom(codec.open(item))
            else:
                _open_payloads(item, codec)


def record(client, history: WorkflowHistory, name: str) -> None:
    """Keep `history` in tests/histories with its payloads opened."""
    codec = client.data_converter.payload_codec
    assert isinstance(codec, EncryptionCodec)
    for event in history.events:
        _open_payloads(event, codec)
    (HISTORIES / f"{name}.json").write_text(history.to_json())
