"""Two instances of the DRA driver on one node, as a DaemonSet that surges runs them during a rolling update: each
on sockets named for it, both registered, one checkpoint and one set of CDI specs shared between them, and the
claims' ledgers taken over by the new one only once the old one has stopped."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import aiohttp
import grpc
import pytest

from gpuppetti.core import cdi
from tests.dra_support import DRIVER, Cluster
from tests.helpers import TWO_M3_MAX
from tests.ledger_client import Process, handed_over
from tests.standins.dra_kubelet import ClaimKey, DraPlugin

pytestmark = pytest.mark.e2e

CONSUMABLE = TWO_M3_MAX + "dra: {slicing: consumable}\n"
OLD = "0b3f1d6e-2a4c-4e8f-9a1b-3c5d7e9f1a2b"
NEW = "7c9e2f4a-6b8d-4c1e-8f3a-5b7d9e1f3a5c"


def _checkpointed(cluster: Cluster) -> set[str]:
    document = json.loads((cluster.plugin_dir / "checkpoint.json").read_text())
    return set(document["claims"])


def _ledger(cluster: Cluster) -> Path:
    [directory] = (cluster.root / "vulkan" / "ledgers").iterdir()
    return directory


async def _share(cluster: Cluster, name: str) -> ClaimKey:
    return await cluster.allocate(name, [{"request": "gpu", "device": "gpu-apple-0", "shareID": name,
                                          "consumedCapacity": {"memory": "8Gi", "cores": "4"}}])


async def test_two_instances_share_the_node_and_the_new_one_takes_the_ledgers_once_the_old_one_stops(
        cluster: Cluster) -> None:
    old = cluster.start_driver(CONSUMABLE, own_process=True, instance=OLD)
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) == 1)
    first = await _share(cluster, "first")
    assert (await cluster.kubelet.prepare([first]))[DRIVER][first.uid].error == ""
    ledger = _ledger(cluster)
    # A container's process of the first claim, connected to the old instance's ledger.
    tenant = await asyncio.to_thread(Process, ledger)
    assert await asyncio.to_thread(tenant.reserve, 1 << 20)

    new = cluster.start_driver(CONSUMABLE, own_process=True, instance=NEW)
    plugin = await cluster.kubelet.wait_registered(DRIVER, count=2)
    assert plugin.endpoint == str(cluster.plugin_dir / f"dra-{NEW}.sock")
    registry = cluster.root / "registry"
    assert {path.name for path in registry.iterdir()} >= {f"{DRIVER}-{OLD}-reg.sock", f"{DRIVER}-{NEW}-reg.sock"}
    assert old.running(), "the new instance left the old one serving"
    # A call the kubelet sent the old one as the new one came: it prepares into the checkpoint both share...
    second = await _share(cluster, "second")
    newer = cluster.kubelet.plugins[DRIVER]
    cluster.kubelet.plugins[DRIVER] = DraPlugin(DRIVER, registry / f"{DRIVER}-{OLD}-reg.sock",
                                                str(cluster.plugin_dir / f"dra-{OLD}.sock"), newer.service,
                                                grpc.aio.insecure_channel(f"unix:{cluster.plugin_dir}/dra-{OLD}.sock"))
    try:
        assert (await cluster.kubelet.prepare([second]))[DRIVER][second.uid].error == ""
    finally:
        await cluster.kubelet.plugins[DRIVER].channel.close()
        cluster.kubelet.plugins[DRIVER] = newer
    # ... and the new one, which the kubelet prefers now, reads it there before it writes its own claim.
    third = await _share(cluster, "third")
    assert (await cluster.kubelet.prepare([third]))[DRIVER][third.uid].error == ""
    assert _checkpointed(cluster) == {first.uid, second.uid, third.uid}
    for claim in (first, second, third):
        assert (cluster.cdi_dir / cdi.spec_filename(cdi.DEFAULT_KIND, claim.uid)).is_file()
    # Asked again, the first claim is answered as prepared: the new instance read what the old one wrote.
    again = (await cluster.kubelet.prepare([first]))[DRIVER][first.uid]
    assert again.error == "" and again.devices
    # The old one still keeps the first claim's ledger: its process holds what it reserved there.
    await asyncio.to_thread(tenant.sync)
    assert tenant.total() == 1 << 20

    assert await old.stop() == 0
    await handed_over(tenant, ledger, new)
    assert not (registry / f"{DRIVER}-{OLD}-reg.sock").exists(), "the old instance removed its own sockets"
    assert (registry / f"{DRIVER}-{NEW}-reg.sock").exists()
    answers = (await cluster.kubelet.unprepare([first, second, third], [DRIVER]))[DRIVER]
    assert all(answer.error == "" for answer in answers.values())
    assert _checkpointed(cluster) == set()
    assert new.running()


async def test_sockets_a_killed_instance_left_go_and_a_live_instances_stay(cluster: Cluster) -> None:
    registry = cluster.root / "registry"
    cluster.plugin_dir.mkdir(parents=True)
    registry.mkdir(parents=True, exist_ok=True)
    dead = [cluster.plugin_dir / f"dra-{OLD}.sock", registry / f"{DRIVER}-{OLD}-reg.sock"]
    for path in dead:
        with socket.socket(socket.AF_UNIX) as left:
            left.bind(str(path))  # bound, never listened on, closed: what a SIGKILL leaves
    live = socket.socket(socket.AF_UNIX)
    live_path = cluster.plugin_dir / "dra-1f2e3d4c5b6a7988.sock"
    live.bind(str(live_path))
    live.listen()
    # Not a name an instance of ours has: someone else's, whatever it is.
    other = cluster.plugin_dir / "dra-other.sock"
    with socket.socket(socket.AF_UNIX) as left:
        left.bind(str(other))
    try:
        driver = cluster.start_driver(instance=NEW)
        # The kubelet stand-in tries the dead registration socket first, for as long as it dials.
        await cluster.kubelet.wait_registered(DRIVER, timeout=30)
        assert not any(path.exists() for path in dead)
        assert live_path.exists() and other.exists()
        assert driver.running()
    finally:
        live.close()


async def test_after_a_restart_the_slices_name_their_claims_pods_again(cluster: Cluster) -> None:
    first = cluster.start_driver(CONSUMABLE, own_process=True)
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) == 1)
    claim = await _share(cluster, "kept")
    assert (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid].error == ""
    assert await first.stop() == 0
    second = cluster.start_driver(CONSUMABLE, own_process=True)
    await cluster.kubelet.wait_registered(DRIVER, count=2)
    url = await second.http_url()

    async def pods() -> set[str]:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/slices") as answer:
            return {row["pod"] for row in await answer.json()}

    # The driver reads the pods of claims it did not prepare itself within PODS_SWEEP_S (5 s).
    async with asyncio.timeout(20):
        while (seen := await pods()) != {"kept-pod"}:
            await asyncio.sleep(0.1)
    assert seen == {"kept-pod"}
