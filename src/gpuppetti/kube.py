"""The Kubernetes API client (the asyncio fork of the official client), configured from a kubeconfig or in-cluster."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from gpuppetti.dra.state import ClaimNotFound

log = logging.getLogger(__name__)

RESOURCE_GROUP = "resource.k8s.io"
RESOURCE_VERSION = "v1"


async def api_client(kubeconfig: Path | None) -> client.ApiClient:
    """A client for ``kubeconfig``, or the in-cluster service account when none is given."""
    if kubeconfig is not None:
        return await config.new_client_from_config(config_file=str(kubeconfig))
    config.load_incluster_config()
    return client.ApiClient()


class ApiClaims:
    """Reads ResourceClaims for Prepare."""

    def __init__(self, api: client.ApiClient) -> None:
        self._custom = client.CustomObjectsApi(api)

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            claim: dict[str, Any] = await self._custom.get_namespaced_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, namespace, "resourceclaims", name
            )
        except ApiException as exc:
            if exc.status == 404:
                raise ClaimNotFound(f"the API server has no ResourceClaim {namespace}/{name}") from exc
            raise
        return claim


async def node_owner(api: client.ApiClient, node: str) -> dict[str, Any] | None:
    """An ownerReference to the Node, so that slices go when the node does; None if the Node cannot be read."""
    try:
        found = await client.CoreV1Api(api).read_node(node)
    except ApiException as exc:
        log.warning("cannot read Node %s (%s %s); publishing ResourceSlices without an owner",
                    node, exc.status, exc.reason)
        return None
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": found.metadata.uid, "controller": True}
