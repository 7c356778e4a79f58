"""The DRA driver under faults: API outages and hangs, full disks, a second instance, odd input, hostile paths.

The driver runs as a subprocess (the real CLI); the kubelet's DRA side and the API stand-in play their parts.
After every fault the invariant holds: what the kubelet was last told, the checkpoint and the CDI directory agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuppetti.core import cdi
from tests.dra_support import DRIVER, Cluster
from tests.helpers import TWO_M3_MAX, Daemon, flood_endpoint
from tests.standins.dra_kubelet import ClaimKey

pytestmark = pytest.mark.fault
KIND = cdi.DEFAULT_KIND


def _checkpoint(cluster: Cluster) -> dict[str, str]:
    path = cluster.plugin_dir / "checkpoint.json"
    if not path.exists():
        return {}
    return {uid: record["state"] for uid, record in json.loads(path.read_text())["claims"].items()}


def _specs(cluster: Cluster) -> set[str]:
    prefix = cdi.spec_prefix(KIND) + "_"
    if not cluster.cdi_dir.exists():
        return set()
    return {p.name.removeprefix(prefix).removesuffix(".json") for p in cluster.cdi_dir.glob(f"{prefix}*.json")}


def assert_agreement(cluster: Cluster, told_prepared: set[str]) -> None:
    """What the kubelet was last told is prepared = the checkpoint's completed claims = the CDI specs."""
    completed = {uid for uid, state in _checkpoint(cluster).items() if state == "PrepareCompleted"}
    assert completed == told_prepared, f"checkpoint {completed} != told {told_prepared}"
    assert _specs(cluster) == told_prepared, f"CDI directory {_specs(cluster)} != told {told_prepared}"


async def _registered_and_published(cluster: Cluster, driver: Daemon) -> None:
    await cluster.kubelet.wait_registered(DRIVER, timeout=20)
    await cluster.wait_slices(lambda s: len(s) == 1, timeout=20)


# -- 1. the API connection breaks --------------------------------------------------------------------------------


async def test_api_restarts_dropped_requests_and_broken_watches_do_not_kill_the_driver(cluster: Cluster) -> None:
    driver = cluster.start_driver()
    await _registered_and_published(cluster, driver)
    claim = await cluster.allocate("before", [{"request": "gpu", "device": "gpu-apple-0"}])
    assert (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid].error == ""

    # A watch that ends with a payload error, and a dropped request.
    cluster.api.fault = lambda method, path: "garbage" if "watch=" in path else None
    await asyncio.sleep(1.0)
    cluster.api.fault = lambda method, path: "drop" if "resourceclaims/dropped" in path else None
    dropped = await cluster.allocate("dropped", [{"request": "gpu", "device": "gpu-apple-1"}])
    answer = (await cluster.kubelet.prepare([dropped]))[DRIVER][dropped.uid]
    assert "ResourceClaim" in answer.error and driver.running()
    cluster.api.fault = None
    # An API server restart cuts every connection.
    await cluster.api.restart(down_for=1.0)
    assert driver.running(), driver.log()[-3000:]
    # It converges once the API is back: a deleted slice comes back, a claim is prepared.
    await cluster.api.delete("resourceslices", cluster.slices()[0]["metadata"]["name"])
    await cluster.wait_slices(lambda s: len(s) == 1, timeout=20)
    assert (await cluster.kubelet.prepare([dropped]))[DRIVER][dropped.uid].error == ""
    assert driver.running()


async def test_started_while_the_api_is_away_it_registers_and_unprepares(cluster: Cluster) -> None:
    await cluster.api.stop()
    driver = cluster.start_driver()
    await cluster.kubelet.wait_registered(DRIVER, timeout=20)
    unknown = ClaimKey("default", "gone", "2b0c1d4e-5f60-4a7b-8c9d-0e1f2a3b4c5d")
    assert (await cluster.kubelet.unprepare([unknown], [DRIVER]))[DRIVER][unknown.uid].error == ""
    await driver.wait_for_log("publishing ResourceSlices failed")
    assert driver.running()
    host, port = cluster.api.url.removeprefix("http://").rsplit(":", 1)
    await cluster.api.start(host, int(port))
    await cluster.wait_slices(lambda s: len(s) == 1, timeout=30)


# -- 2. a hung API read ------------------------------------------------------------------------------------------


async def test_a_hung_claim_read_holds_up_neither_other_claims_nor_unprepare(cluster: Cluster) -> None:
    driver = cluster.start_driver(api_timeout=3)
    await _registered_and_published(cluster, driver)
    done = await cluster.allocate("done", [{"request": "gpu", "device": "gpu-apple-0"}])
    assert (await cluster.kubelet.prepare([done]))[DRIVER][done.uid].error == ""
    hung = await cluster.allocate("hung", [{"request": "gpu", "device": "gpu-apple-1"}])
    cluster.api.fault = lambda method, path: "hang" if "resourceclaims/hung" in path else None
    preparing = asyncio.ensure_future(cluster.kubelet.prepare([hung]))
    await asyncio.sleep(0.5)
    began = time.monotonic()
    answer = (await cluster.kubelet.unprepare([done], [DRIVER]))[DRIVER][done.uid]
    # The hung read holds for the 3 s API timeout; waiting for it would take over 2 s more.
    assert answer.error == "" and time.monotonic() - began < 2.0, "Unprepare waits for no API read"
    # The hung read is bounded: the claim gets its own error, and the kubelet's retry can succeed.
    result = (await asyncio.wait_for(preparing, 10))[DRIVER][hung.uid]
    assert "no answer within 3s" in result.error, result.error
    cluster.api.fault = None
    assert (await cluster.kubelet.prepare([hung]))[DRIVER][hung.uid].error == ""
    assert_agreement(cluster, {hung.uid})


async def test_held_connections_and_abandoned_scrapes_leave_prepare_fast(cluster: Cluster) -> None:
    # At a container runtime's soft limit of 1,024 descriptors: 1,500 connections to the endpoint that say nothing,
    # then 3,000 scrapes whose clients give up at once. Every Prepare and Unprepare still succeeds at once.
    driver = cluster.start_driver(open_files=1024)
    await _registered_and_published(cluster, driver)
    host, port = (await driver.http_url()).removeprefix("http://").rsplit(":", 1)
    held: list[asyncio.StreamWriter] = []
    try:
        await flood_endpoint(host, int(port), held)
        for n in range(7):
            claim = await cluster.allocate(f"c{n}", [{"request": "gpu", "device": f"gpu-apple-{n % 2}"}])
            began = time.monotonic()
            assert (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid].error == ""
            assert (await cluster.kubelet.unprepare([claim], [DRIVER]))[DRIVER][claim.uid].error == ""
            assert time.monotonic() - began < 1.0, f"Prepare {n} took {time.monotonic() - began:.1f}s"
        assert driver.running()
        # Its log is at debug level here: what counts is that running short of descriptors is said once at most.
        short = [line for line in driver.log().splitlines() if "Too many open files" in line]
        assert len(short) <= 1, short[:5]
    finally:
        for writer in held:
            writer.close()


# -- 3 and 4. full disks -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def small_disk(path: Path, size: str = "256k") -> Iterator[Path]:
    """A tiny tmpfs at ``path``, to fill up; needs root (mount)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("filling a disk needs root to mount a small tmpfs")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    with contextlib.suppress(OSError), filler.open("wb") as handle:
        while True:
            handle.write(b"\0" * 4096)
            handle.flush()
    return filler


async def test_a_full_disk_never_leaves_the_checkpoint_disagreeing_with_the_kubelet(cluster: Cluster) -> None:
    with small_disk(cluster.root / "plugins"):
        driver = cluster.start_driver()
        await _registered_and_published(cluster, driver)
        first = await cluster.allocate("first", [{"request": "gpu", "device": "gpu-apple-0"}])
        second = await cluster.allocate("second", [{"request": "gpu", "device": "gpu-apple-1"}])
        assert (await cluster.kubelet.prepare([first]))[DRIVER][first.uid].error == ""
        told = {first.uid}
        filler = fill(cluster.root / "plugins")
        # Prepare on a full disk: refused, and nothing of it is left anywhere.
        answer = (await cluster.kubelet.prepare([second]))[DRIVER][second.uid]
        assert "saving the checkpoint" in answer.error, answer.error
        assert_agreement(cluster, told)
        # Unprepare on a full disk: refused, so that the kubelet retries; the claim stays prepared everywhere.
        gone = (await cluster.kubelet.unprepare([first], [DRIVER]))[DRIVER][first.uid]
        assert "saving the checkpoint" in gone.error, gone.error
        retried = (await cluster.kubelet.unprepare([first], [DRIVER]))[DRIVER][first.uid]
        assert retried.error, "the retry on a disk still full fails too, rather than answering from memory"
        assert_agreement(cluster, told)
        filler.unlink()
        # Space is back: the kubelet's retries succeed, and all three agree.
        assert (await cluster.kubelet.unprepare([first], [DRIVER]))[DRIVER][first.uid].error == ""
        assert (await cluster.kubelet.prepare([second]))[DRIVER][second.uid].error == ""
        assert_agreement(cluster, {second.uid})
        assert driver.running()
        await driver.stop()


async def test_a_full_cdi_directory_at_start_keeps_the_driver_up_and_heals(cluster: Cluster) -> None:
    driver = cluster.start_driver()
    await _registered_and_published(cluster, driver)
    claim = await cluster.allocate("kept", [{"request": "gpu", "device": "gpu-apple-0"}])
    assert (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid].error == ""
    await driver.stop()
    with small_disk(cluster.cdi_dir, "64k"):
        filler = fill(cluster.cdi_dir)
        restarted = cluster.start_driver()
        await restarted.wait_for_log("cannot re-create the CDI spec of prepared claim")
        await cluster.kubelet.wait_registered(DRIVER, count=2, timeout=20)
        url = await restarted.http_url()
        assert "gpuppetti_dra_claims_missing_cdi_spec 1.0" in await _get(url + "/metrics")
        answer = (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid]
        assert "CDI spec" in answer.error, "the kubelet hears why, per claim"
        filler.unlink()
        async with asyncio.timeout(40):
            while not _specs(cluster):
                await asyncio.sleep(0.2)
        assert (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid].error == ""
        assert_agreement(cluster, {claim.uid})
        assert restarted.running()
        await restarted.stop()


async def _get(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


# -- 5. a second instance ----------------------------------------------------------------------------------------


async def test_a_second_instance_waits_and_takes_over_cleanly(cluster: Cluster) -> None:
    first = cluster.start_driver()
    await _registered_and_published(cluster, first)
    socket = cluster.plugin_dir / "dra.sock"
    inode = socket.stat().st_ino
    second = cluster.start_driver()
    await second.wait_for_log("another instance of the driver serves")
    await asyncio.sleep(1.0)
    assert socket.stat().st_ino == inode, "the second did not touch the first's socket"
    assert second.running()
    assert await first.stop() == 0
    await second.wait_for_log("the other instance stopped")
    await cluster.kubelet.wait_registered(DRIVER, count=2, timeout=20)
    assert socket.exists(), "the first's clean stop left the second's socket alone"
    claim = await cluster.allocate("after", [{"request": "gpu", "device": "gpu-apple-0"}])
    assert (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid].error == ""


# -- 6. odd quantities -------------------------------------------------------------------------------------------


async def test_every_valid_quantity_is_read_and_one_bad_claim_fails_alone(cluster: Cluster) -> None:
    driver = cluster.start_driver(TWO_M3_MAX + "dra: {slicing: consumable}\n")
    await _registered_and_published(cluster, driver)
    forms = {"8e9": 8 * 10**9, "1E3": 1000, "+4Gi": 4 * 2**30, "12Gi": 12 * 2**30}
    claims = {}
    for n, (memory, _) in enumerate(forms.items()):
        claims[memory] = await cluster.allocate(f"q{n}", [{"request": "gpu", "device": "gpu-apple-0",
                                                           "shareID": f"s{n}",
                                                           "consumedCapacity": {"memory": memory, "cores": "1"}}])
    half = await cluster.allocate("half", [{"request": "gpu", "device": "gpu-apple-1", "shareID": "h",
                                            "consumedCapacity": {"memory": ".5"}}])
    answers = (await cluster.kubelet.prepare([*claims.values(), half]))[DRIVER]
    for memory, claim in claims.items():
        assert answers[claim.uid].error == "", (memory, answers[claim.uid].error)
        env = _env(cluster, claim)
        assert env["GPUPPETTI_MEMORY"] == str(forms[memory])
    assert "memory" in answers[half.uid].error and "whole" in answers[half.uid].error


def _env(cluster: Cluster, claim: ClaimKey) -> dict[str, str]:
    spec = json.loads((cluster.cdi_dir / cdi.spec_filename(KIND, claim.uid)).read_text())
    return dict(line.split("=", 1) for line in spec["devices"][0]["containerEdits"]["env"])


# -- 7. a reload that changes what cannot change ------------------------------------------------------------------


async def test_a_reload_changing_the_driver_name_is_refused(cluster: Cluster) -> None:
    driver = cluster.start_driver()
    await _registered_and_published(cluster, driver)
    driver.write_config(TWO_M3_MAX + "dra: {driverName: other.example.com}\n")
    driver.send(signal.SIGHUP)
    await driver.wait_for_log("config reload refused")
    assert "dra.driverName ('gpu.gpuppetti.dev' -> 'other.example.com')" in driver.log()
    await asyncio.sleep(1.0)
    assert {s["spec"]["driver"] for s in cluster.slices()} == {DRIVER}
    claim = await cluster.allocate("still", [{"request": "gpu", "device": "gpu-apple-0"}])
    assert (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid].error == ""


# -- 8. checkpoints from elsewhere -------------------------------------------------------------------------------


async def test_a_newer_checkpoint_keeps_its_claims_and_a_directory_is_moved_aside(cluster: Cluster) -> None:
    driver = cluster.start_driver()
    await _registered_and_published(cluster, driver)
    claim = await cluster.allocate("kept", [{"request": "gpu", "device": "gpu-apple-0"}])
    assert (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid].error == ""
    await driver.stop()
    path = cluster.plugin_dir / "checkpoint.json"
    document = json.loads(path.read_text())
    document.update(version="v7", checksum="computed the newer way")
    document["claims"][claim.uid]["extra"] = {"from": "the future"}
    path.write_text(json.dumps(document))
    for spec in cluster.cdi_dir.glob("*.json"):
        spec.unlink()
    newer = cluster.start_driver()
    await newer.wait_for_log("written by a newer gpuppetti")
    await cluster.kubelet.wait_registered(DRIVER, count=2, timeout=20)
    assert _specs(cluster) == {claim.uid}, "its claims' CDI specs come back"
    assert list(cluster.plugin_dir.glob("checkpoint.json.v7-*")), "the newer file is kept"
    await newer.stop()

    path.unlink()
    path.mkdir()
    # Not a crash loop under a DaemonSet: moved aside, and the driver serves (its claims prepared again on retry).
    serving = cluster.start_driver()
    await serving.wait_for_log("a directory, not a file")
    await cluster.kubelet.wait_registered(DRIVER, count=3, timeout=20)
    assert list(cluster.plugin_dir.glob("checkpoint.json.corrupt-*"))
    assert "Traceback" not in serving.log()
    await serving.stop()


# -- 9. claim UIDs that are paths --------------------------------------------------------------------------------


async def test_a_claim_uid_that_is_a_path_touches_no_file(cluster: Cluster) -> None:
    driver = cluster.start_driver()
    await _registered_and_published(cluster, driver)
    victim = cluster.root / "victim"
    victim.write_text("precious")
    hostile = os.path.relpath(victim, cluster.cdi_dir).removesuffix("victim") + "victim"
    for uid in (f"../../../{hostile}", "../victim", "a/b", "x" * 5000):
        claim = ClaimKey("default", "hostile", uid)
        # Straight to the driver, as a confused or hostile kubelet would send them.
        unprepared = (await cluster.kubelet.call(DRIVER, "unprepare", [claim]))[uid]
        prepared = (await cluster.kubelet.call(DRIVER, "prepare", [claim]))[uid]
        assert "not a Kubernetes UID" in unprepared.error and "not a Kubernetes UID" in prepared.error
    assert victim.read_text() == "precious"
    assert driver.running()


# -- 17 (the driver's part). planted links and an open umask --------------------------------------------------------


async def test_planted_links_are_not_followed_and_modes_ignore_the_umask(cluster: Cluster) -> None:
    victim = cluster.root / "victim"
    victim.write_text("precious")
    victim.chmod(0o600)
    claim = await cluster.allocate("linked", [{"request": "gpu", "device": "gpu-apple-0"}])
    spec_name = cdi.spec_filename(KIND, claim.uid)
    cluster.cdi_dir.mkdir(parents=True)
    # The temporary name the driver used to write through, and the spec's own name.
    (cluster.cdi_dir / f".{spec_name}.tmp").symlink_to(victim)
    (cluster.cdi_dir / spec_name).symlink_to(victim)
    driver = cluster.start_driver(umask=0)
    await _registered_and_published(cluster, driver)
    assert (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid].error == ""
    assert victim.read_text() == "precious" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    spec = cluster.cdi_dir / spec_name
    assert not spec.is_symlink() and stat.S_IMODE(spec.stat().st_mode) == 0o644
    for path in (cluster.plugin_dir, cluster.root / "registry"):
        assert not stat.S_IMODE(path.stat().st_mode) & 0o022, f"{path} is writable by others"
    for socket in (cluster.plugin_dir / "dra.sock", cluster.root / "registry" / f"{DRIVER}-reg.sock"):
        assert stat.S_IMODE(socket.stat().st_mode) == 0o600
    checkpoint = cluster.plugin_dir / "checkpoint.json"
    assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o600


# -- 28.9. what is left at the registration socket's name -----------------------------------------------------------


def _healthz(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_a_dangling_link_at_the_registration_socket_is_replaced(cluster: Cluster) -> None:
    registry = cluster.root / "registry"
    registry.mkdir(parents=True, exist_ok=True)
    (registry / f"{DRIVER}-reg.sock").symlink_to(cluster.root / "gone")
    driver = cluster.start_driver()
    await _registered_and_published(cluster, driver)
    assert stat.S_ISSOCK((registry / f"{DRIVER}-reg.sock").lstat().st_mode)
    assert not (cluster.root / "gone").exists(), "the link went, not through it"
    await driver.stop()


async def test_a_file_at_the_registration_socket_is_named_by_healthz_not_the_kubelet(cluster: Cluster) -> None:
    registry = cluster.root / "registry"
    registry.mkdir(parents=True, exist_ok=True)
    (registry / f"{DRIVER}-reg.sock").write_text("someone's")
    driver = cluster.start_driver()
    await driver.wait_for_log("a file that is not a socket")
    status, body = await asyncio.to_thread(_healthz, await driver.http_url())
    assert status == 503 and "registration socket" in body and "a file that is not a socket" in body, body
    assert "kubelet has not confirmed" not in body
    assert (registry / f"{DRIVER}-reg.sock").read_text() == "someone's"
    await driver.stop()
