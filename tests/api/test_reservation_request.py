"""What `POST /v1/reservations` refuses before anything is read from the database: each error
names its field (the API answers them as 422)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpucloud.models.api_schemas import PoolShareRequest, ReservationRequest

pytestmark = pytest.mark.unit

GOOD = {
    "gpu_type": "h100",
    "region": "us-east-1",
    "node_count": 2,
    "start_at": "2027-01-04T08:00:00Z",
    "end_at": "2027-01-04T20:00:00Z",
}


def test_a_good_request_names_the_gpu_type_as_the_catalog_does() -> None:
    assert ReservationRequest.model_validate(GOOD).gpu_type == "H100"


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("region", "../etc", "region name"),
        ("region", "US East", "region name"),
        ("gpu_type", "Z9000", "unknown GPU type"),
        ("node_count", 0, "greater than or equal to 1"),
        ("start_at", "2027-01-04T08:00:00", "time zone"),
    ],
)
def test_bad_fields_are_refused_naming_the_field(field: str, value: object, says: str) -> None:
    with pytest.raises(ValidationError) as refused:
        ReservationRequest.model_validate({**GOOD, field: value})
    (error,) = refused.value.errors()
    assert error["loc"] == (field,) and says in str(error["msg"])


def test_a_pool_share_names_its_pool_as_the_queue_does() -> None:
    """A share for `h100` must weigh the requests queued in `H100`: one spelt otherwise would be
    stored and never apply."""
    share = PoolShareRequest.model_validate({"gpu_type": "h100", "region": "us-east-1", "weight": 2})
    assert (share.gpu_type, share.region) == ("H100", "us-east-1")
    for field, value, says in [("gpu_type", "Z9000", "unknown GPU type"), ("region", "US East", "region name")]:
        with pytest.raises(ValidationError) as refused:
            PoolShareRequest.model_validate({"gpu_type": "H100", "region": "us-east-1", "weight": 1, field: value})
        (error,) = refused.value.errors()
        assert error["loc"] == (field,) and says in str(error["msg"])
