"""Settings refuse values that would make no sense, naming the setting."""

import pytest
from pydantic import ValidationError

from gpucloud.config import Settings


def test_a_negative_provision_retry_budget_is_refused(monkeypatch):
    monkeypatch.setenv("GPUCLOUD_HEALTH__PROVISION_RETRIES", "-1")
    with pytest.raises(ValidationError, match="provision_retries"):
        Settings()
    monkeypatch.setenv("GPUCLOUD_HEALTH__PROVISION_RETRIES", "0")
    assert Settings().health.provision_retries == 0
