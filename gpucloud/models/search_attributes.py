"""Search attributes, declared once: fed to the dev server flags, the tests and the workflows,
so operators can filter node and allocation workflows in the Temporal Web UI."""

from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

NODE_ID = SearchAttributeKey.for_keyword("NodeId")
NODE_STATE = SearchAttributeKey.for_keyword("NodeState")
TENANT_ID = SearchAttributeKey.for_keyword("TenantId")
ALLOCATION_ID = SearchAttributeKey.for_keyword("AllocationId")
MODEL_VERSION = SearchAttributeKey.for_keyword("ModelVersion")

ALL = (NODE_ID, NODE_STATE, TENANT_ID, ALLOCATION_ID, MODEL_VERSION)


def server_flags() -> list[str]:
    """`--search-attribute Name=Keyword` flags for `temporal server start-dev`."""
    flags: list[str] = []
    for key in ALL:
        flags += ["--search-attribute", f"{key.name}=Keyword"]
    return flags


def typed(*pairs: tuple[SearchAttributeKey, str]) -> TypedSearchAttributes:
    """Search attributes for a workflow start: `typed((NODE_ID, "n1"), (TENANT_ID, "t1"))`."""
    return TypedSearchAttributes([SearchAttributePair(key, value) for key, value in pairs])
