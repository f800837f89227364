"""What an operator may do: a role is a set of scopes, and every operator route of the API
declares the one scope it needs (`api.deps`). Pure data, shared by the API and the CLI.

- `read`: every GET an operator may make (fleet, tenants, billing);
- `fleet`: node actions, power, enrolment, agent credentials, XID drills, rollout control,
  allocation cancels, registry GC, the simulated fleet's reports;
- `billing`: the price book, and an operator's ledger token (it may change the books);
- `tenants`: onboarding, offboarding, quotas, a tenant's API keys;
- `operators`: operator accounts.
"""

from __future__ import annotations

from enum import StrEnum


class Scope(StrEnum):
    READ = "read"
    FLEET = "fleet"
    BILLING = "billing"
    TENANTS = "tenants"
    OPERATORS = "operators"


class Role(StrEnum):
    READ_ONLY = "read-only"
    FLEET = "fleet-operator"
    BILLING = "billing-admin"
    ADMIN = "admin"


ROLE_SCOPES: dict[Role, frozenset[Scope]] = {
    Role.READ_ONLY: frozenset({Scope.READ}),
    Role.FLEET: frozenset({Scope.READ, Scope.FLEET}),
    Role.BILLING: frozenset({Scope.READ, Scope.BILLING, Scope.TENANTS}),
    Role.ADMIN: frozenset(Scope),
}
