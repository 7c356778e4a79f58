"""The API stand-in behaves like an API server where clients depend on it, seen through the real client (lightkube,
the one gpuppetti.node.kube uses)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import httpx2
import pytest
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceClaim as Claim
from lightkube.resources.resource_v1 import ResourceSlice as Slice
from lightkube.types import PatchType

from gpuppetti.node import kube
from gpuppetti.node.kube import load_config
from tests.standins.apiserver import ApiStandIn


def _slice(name: str, node: str = "n1") -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": "d.example.com", "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                          "resourceSliceCount": 1}}}


Api = tuple[ApiStandIn, AsyncClient]


def as_slice(document: dict[str, Any]) -> Slice:
    return cast(Slice, Slice.from_dict(document))


def as_claim(document: dict[str, Any]) -> Claim:
    return cast(Claim, Claim.from_dict(document))


def as_claim_status(document: dict[str, Any]) -> Any:
    return Claim.Status.from_dict(document)


async def _connected(standin: ApiStandIn, directory: Path) -> AsyncClient:
    (directory / "kubeconfig").write_text(standin.kubeconfig())
    return AsyncClient(load_config(directory / "kubeconfig"), field_manager="test")


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    standin = ApiStandIn()
    await standin.start()
    client = await _connected(standin, tmp_path)
    yield standin, client
    await client.close()
    await standin.stop()


async def test_resource_versions_and_conflicts(api: Api) -> None:
    _, client = api
    created = (await client.create(as_slice(_slice("a")))).to_dict()
    first = created["metadata"]["resourceVersion"]
    assert created["metadata"]["uid"]
    with pytest.raises(ApiError) as exists:
        await client.create(as_slice(_slice("a")))
    assert exists.value.status.code == 409
    created["spec"]["pool"]["generation"] = 2
    updated = (await client.replace(as_slice(created))).to_dict()
    assert int(updated["metadata"]["resourceVersion"]) > int(first)
    assert updated["metadata"]["generation"] == 2
    created["metadata"]["resourceVersion"] = first  # stale
    with pytest.raises(ApiError) as conflict:
        await client.replace(as_slice(created))
    assert conflict.value.status.code == 409
    await client.delete(Slice, "a")
    with pytest.raises(ApiError) as gone:
        await client.get(Slice, "a")
    assert gone.value.status.code == 404


async def test_field_selectors_and_watch_replay(api: Api) -> None:
    standin, client = api
    await client.create(as_slice(_slice("mine", "n1")))
    await client.create(as_slice(_slice("theirs", "n2")))
    listing = [item.to_dict() async for item in client.list(Slice, fields={"spec.nodeName": "n1"})]
    assert [i["metadata"]["name"] for i in listing] == ["mine"]
    since = listing[0]["metadata"]["resourceVersion"]
    await standin.delete("resourceslices", "mine")
    await standin.delete("resourceslices", "theirs")
    events = []
    async for event, item in client.watch(Slice, fields={"spec.nodeName": "n1"}, resource_version=since,
                                          server_timeout=1):
        assert item.metadata is not None
        events.append((event, item.metadata.name))
        break
    assert events == [("DELETED", "mine")]


async def test_a_list_comes_in_pages_and_the_driver_keeps_only_the_claims_it_named(
        api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    standin, client = api
    for n in range(5):
        await client.create(as_slice(_slice(f"s{n}")))
    pages = []
    async for item in client.list(Slice, chunk_size=2):
        assert item.metadata is not None
        pages.append(item.metadata.name)
    assert pages == [f"s{n}" for n in range(5)], "every item once, in order, across three pages"
    listed = [path for method, path in standin.requests if method == "GET" and "/resourceslices?" in path]
    assert len(listed) == 3 and "continue=" in listed[-1], listed

    monkeypatch.setattr(kube, "LIST_PAGE", 2)
    for n in range(5):
        await standin.create("resourceclaims", {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                                "metadata": {"name": f"c{n}", "namespace": "ns"}}, "ns")
    driver_api = kube.Kube(load_config(tmp_path / "kubeconfig"))
    try:
        found = {claim.metadata.name: claim async for claim in driver_api.list_claims("ns", {"c0", "c4", "missing"})}
    finally:
        await driver_api.close()
    assert sorted(found) == ["c0", "c4"]
    assert len([path for _, path in standin.requests if "/resourceclaims?" in path]) == 3, "in pages of two"
    assert found["c0"].metadata.namespace == "ns"


async def test_an_answer_that_is_not_a_claim_is_one_api_error_naming_where(api: Api, tmp_path: Path) -> None:
    standin, _ = api
    await standin.create("resourceclaims", {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                            "metadata": {"name": "odd", "namespace": "ns"}}, "ns")
    # As a broken proxy or a newer server might answer: a field of the wrong type.
    standin.objects[("resourceclaims", "ns", "odd")]["status"] = {"allocation": {"devices": {"results": [
        {"device": 7}]}}}
    driver_api = kube.Kube(load_config(tmp_path / "kubeconfig"))
    try:
        with pytest.raises(kube.ApiError) as raised:
            await driver_api.get_claim("ns", "odd")
    finally:
        await driver_api.close()
    message = str(raised.value)
    assert message.startswith("reading ResourceClaim ns/odd: the answer is not what was asked for"), message
    assert "$.status.allocation.devices.results[0].device" in message, message


async def test_a_page_with_a_claim_of_the_wrong_shape_fails_whole_naming_where(api: Api, tmp_path: Path) -> None:
    # A page is decoded straight into the driver's types: a claim it was not asked for breaks the page too, and
    # the driver then reads the claims it wants by name (test_dra_driver).
    standin, _ = api
    for name in ("c0", "odd"):
        await standin.create("resourceclaims", {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                                "metadata": {"name": name, "namespace": "ns"}}, "ns")
    standin.objects[("resourceclaims", "ns", "odd")]["status"] = {"reservedFor": "everyone"}
    driver_api = kube.Kube(load_config(tmp_path / "kubeconfig"))
    try:
        with pytest.raises(kube.ApiError) as raised:
            [claim async for claim in driver_api.list_claims("ns", {"c0"})]
        assert (await driver_api.get_claim("ns", "c0")).metadata.name == "c0"
    finally:
        await driver_api.close()
    message = str(raised.value)
    assert message.startswith("listing the ResourceClaims of namespace ns: the answer is not what was asked for")
    assert "$.items[1].status.reservedFor" in message, message


async def test_too_old_resource_version_is_gone(api: Api) -> None:
    standin, client = api
    from tests.standins import apiserver

    for n in range(apiserver.HISTORY + 5):
        await standin.create("resourceslices", _slice(f"s{n}"))
    # lightkube raises a watch's refusal as the HTTP error it is.
    with pytest.raises(httpx2.HTTPStatusError) as expired:
        async for _ in client.watch(Slice, resource_version="1", server_timeout=1):
            pass
    assert expired.value.response.status_code == 410


async def test_status_subresource_and_merge_patch(api: Api) -> None:
    standin, client = api
    await standin.create("nodes", {"apiVersion": "v1", "kind": "Node",
                                   "metadata": {"name": "n1", "labels": {"a": "1"}}})
    await client.patch(Node, "n1", {"metadata": {"labels": {"b": "2", "a": None}}}, patch_type=PatchType.MERGE)
    node = standin.get("nodes", "n1")
    assert node is not None and node["metadata"]["labels"] == {"b": "2"}
    claim = await standin.create("resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"devices": {"requests": []}}}, "ns")
    claim["status"] = {"allocation": {"devices": {"results": []}}}
    replaced = (await client.replace(as_claim(claim))).to_dict()
    assert "status" not in replaced, "the main resource cannot write the status"
    replaced["status"] = {"allocation": {"devices": {"results": []}}}
    with_status: dict[str, Any] = (await client.replace(as_claim_status(replaced))).to_dict()
    assert with_status["status"] == {"allocation": {"devices": {"results": []}}}


async def test_a_validator_rejects_with_422(tmp_path: Path) -> None:
    def refuse(obj: dict[str, object]) -> None:
        raise ValueError("spec.devices: too many")

    standin = ApiStandIn(validate=refuse)
    await standin.start()
    client = await _connected(standin, tmp_path)
    try:
        with pytest.raises(ApiError) as invalid:
            await client.create(as_slice(_slice("x")))
        assert invalid.value.status.code == 422 and "too many" in str(invalid.value.status.message)
        assert len(standin.rejected) == 1
    finally:
        await client.close()
        await standin.stop()
