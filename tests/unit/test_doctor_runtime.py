"""Where ``gpuppetti doctor`` looks for the container runtime: the endpoint given, else containerd's own address
(CONTAINERD_ADDRESS, as ctr takes it), else the usual sockets; under --host-root too."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuppetti.base.nodepaths import CRI_SOCKETS
from gpuppetti.cli.main import parse
from gpuppetti.commands.doctor.checks import _cri_candidates, runtime_checks
from gpuppetti.commands.doctor.result import Status
from tests.helpers import short_tmpdir
from tests.standins.cri import CriStandIn

CDI_ON = {"enableCDI": True, "cdiSpecDirs": ["/etc/cdi", "/var/run/cdi"]}


def test_containerd_address_is_read_as_ctr_reads_it() -> None:
    assert parse(["doctor"], {}).containerd_address is None
    assert parse(["doctor"], {"CONTAINERD_ADDRESS": "/run/k0s/containerd.sock"}).containerd_address == Path(
        "/run/k0s/containerd.sock")
    assert parse(["doctor"], {"CONTAINERD_ADDRESS": "unix:///run/x.sock"}).containerd_address == Path("/run/x.sock")
    assert parse(["doctor", "--containerd-address", "/a.sock"],
                 {"CONTAINERD_ADDRESS": "/b.sock"}).containerd_address == Path("/a.sock"), "the flag wins"


def test_containerd_address_is_looked_at_first_under_the_host_root_too() -> None:
    address = Path("/run/k0s/containerd.sock")
    assert _cri_candidates(Path("/"), address) == [address, *CRI_SOCKETS]
    assert _cri_candidates(Path("/host"), address)[:2] == [Path("/host/run/k0s/containerd.sock"), address]
    assert _cri_candidates(Path("/"), CRI_SOCKETS[0]) == list(CRI_SOCKETS), "a usual socket is not looked at twice"
    assert _cri_candidates(Path("/host"), Path("containerd.sock"))[0] == Path("containerd.sock"), "relative: as is"


@pytest.fixture
def directory() -> Iterator[Path]:
    path = short_tmpdir("gp-ctrd-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_the_runtime_at_containerd_address_is_the_one_asked(directory: Path) -> None:
    socket = directory / "containerd.sock"
    async with CriStandIn(socket, "containerd", "v2.1.4", CDI_ON):
        results = await runtime_checks(None, Path("/nonexistent-host-root"), Path("/var/run/cdi"), socket)
    assert results[0].status == Status.OK, results
    assert results[0].detail == f"containerd 2.1.4 (CRI v1) at {socket}"


async def test_a_containerd_address_with_nothing_there_is_named_in_the_failure(directory: Path) -> None:
    missing = directory / "containerd.sock"
    results = await runtime_checks(None, Path("/"), Path("/var/run/cdi"), missing)
    if results[0].status == Status.FAIL:  # else this machine has a runtime at a usual socket, found after it
        assert results[0].detail.startswith(f"no CRI socket at {missing}, ")
        assert results[0].fix is not None and "CONTAINERD_ADDRESS" in results[0].fix
    else:
        assert str(missing) not in results[0].detail
