"""The API stand-in behaves like an API server where clients depend on it, seen through the real client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from gpuppetti.kube import api_client
from tests.standins.apiserver import ApiStandIn

GROUP, VERSION = "resource.k8s.io", "v1"


def _slice(name: str, node: str = "n1") -> dict[str, object]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": "d.example.com", "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                          "resourceSliceCount": 1}}}


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[ApiStandIn, client.CustomObjectsApi, client.CoreV1Api]]:
    standin = ApiStandIn()
    await standin.start()
    (tmp_path / "kubeconfig").write_text(standin.kubeconfig())
    kube = await api_client(tmp_path / "kubeconfig")
    yield standin, client.CustomObjectsApi(kube), client.CoreV1Api(kube)
    await kube.close()
    await standin.stop()


Api = tuple[ApiStandIn, client.CustomObjectsApi, client.CoreV1Api]


async def test_resource_versions_and_conflicts(api: Api) -> None:
    _, custom, _ = api
    created = await custom.create_cluster_custom_object(GROUP, VERSION, "resourceslices", _slice("a"))
    first = created["metadata"]["resourceVersion"]
    assert created["metadata"]["uid"]
    with pytest.raises(ApiException) as exists:
        await custom.create_cluster_custom_object(GROUP, VERSION, "resourceslices", _slice("a"))
    assert exists.value.status == 409
    created["spec"]["pool"]["generation"] = 2
    updated = await custom.replace_cluster_custom_object(GROUP, VERSION, "resourceslices", "a", created)
    assert int(updated["metadata"]["resourceVersion"]) > int(first)
    assert updated["metadata"]["generation"] == 2
    created["metadata"]["resourceVersion"] = first  # stale
    with pytest.raises(ApiException) as conflict:
        await custom.replace_cluster_custom_object(GROUP, VERSION, "resourceslices", "a", created)
    assert conflict.value.status == 409
    await custom.delete_cluster_custom_object(GROUP, VERSION, "resourceslices", "a")
    with pytest.raises(ApiException) as gone:
        await custom.get_cluster_custom_object(GROUP, VERSION, "resourceslices", "a")
    assert gone.value.status == 404


async def test_field_selectors_and_watch_replay(
    api: tuple[ApiStandIn, client.CustomObjectsApi, client.CoreV1Api]
) -> None:
    standin, custom, _ = api
    await custom.create_cluster_custom_object(GROUP, VERSION, "resourceslices", _slice("mine", "n1"))
    await custom.create_cluster_custom_object(GROUP, VERSION, "resourceslices", _slice("theirs", "n2"))
    listing = await custom.list_cluster_custom_object(GROUP, VERSION, "resourceslices",
                                                      field_selector="spec.nodeName=n1")
    assert [i["metadata"]["name"] for i in listing["items"]] == ["mine"]
    since = listing["metadata"]["resourceVersion"]
    await standin.delete("resourceslices", "mine")
    await standin.delete("resourceslices", "theirs")
    events = []
    async with watch.Watch() as stream:
        async for event in stream.stream(custom.list_cluster_custom_object, GROUP, VERSION, "resourceslices",
                                         field_selector="spec.nodeName=n1", resource_version=since,
                                         timeout_seconds=1):
            events.append((event["type"], event["object"]["metadata"]["name"]))
    assert events == [("DELETED", "mine")]


async def test_too_old_resource_version_is_gone(
    api: tuple[ApiStandIn, client.CustomObjectsApi, client.CoreV1Api]
) -> None:
    standin, custom, _ = api
    from tests.standins import apiserver

    for n in range(apiserver.HISTORY + 5):
        await standin.create("resourceslices", _slice(f"s{n}"))
    with pytest.raises(ApiException) as expired:
        await custom.list_cluster_custom_object(GROUP, VERSION, "resourceslices", watch=True, resource_version="1",
                                                timeout_seconds=1)
    assert expired.value.status == 410


async def test_status_subresource_and_merge_patch(
    api: tuple[ApiStandIn, client.CustomObjectsApi, client.CoreV1Api]
) -> None:
    standin, custom, core = api
    await standin.create("nodes", {"apiVersion": "v1", "kind": "Node",
                                   "metadata": {"name": "n1", "labels": {"a": "1"}}})
    await core.patch_node("n1", {"metadata": {"labels": {"b": "2", "a": None}}})
    node = standin.get("nodes", "n1")
    assert node is not None and node["metadata"]["labels"] == {"b": "2"}
    claim = await standin.create("resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"devices": {"requests": []}}}, "ns")
    claim["status"] = {"allocation": {"devices": {"results": []}}}
    replaced = await custom.replace_namespaced_custom_object(GROUP, VERSION, "ns", "resourceclaims", "c", claim)
    assert "status" not in replaced, "the main resource cannot write the status"
    replaced["status"] = {"allocation": {"devices": {"results": []}}}
    with_status = await custom.replace_namespaced_custom_object_status(GROUP, VERSION, "ns", "resourceclaims", "c",
                                                                       replaced)
    assert with_status["status"] == {"allocation": {"devices": {"results": []}}}


async def test_a_validator_rejects_with_422(tmp_path: Path) -> None:
    def refuse(obj: dict[str, object]) -> None:
        raise ValueError("spec.devices: too many")

    standin = ApiStandIn(validate=refuse)
    await standin.start()
    (tmp_path / "kubeconfig").write_text(standin.kubeconfig())
    kube = await api_client(tmp_path / "kubeconfig")
    try:
        with pytest.raises(ApiException) as invalid:
            await client.CustomObjectsApi(kube).create_cluster_custom_object(GROUP, VERSION, "resourceslices",
                                                                             _slice("x"))
        assert invalid.value.status == 422 and "too many" in str(invalid.value.body)
        assert len(standin.rejected) == 1
    finally:
        await kube.close()
        await standin.stop()
