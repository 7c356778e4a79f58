"""The kit's DRA helper: the claim checks made once, before the driver's callbacks, and every claim answered."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuppetti.kit.draplugin import ClaimRef, DraService, PreparedDevice
from gpuppetti.node.metrics import Metrics

GOOD = ClaimRef("default", "3f2a1b0c-0000-4000-8000-000000000001", "good")
FAILING = ClaimRef("default", "3f2a1b0c-0000-4000-8000-000000000002", "failing")
HOSTILE = ClaimRef("default", "../../etc/passwd", "hostile")
DEVICE = PreparedDevice(["gpu"], "node1", "gpu-apple-0", ["k/c=claim"])


class Driver:
    def __init__(self, broken: bool = False) -> None:
        self.given: list[list[ClaimRef]] = []
        self.broken = broken

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, Sequence[PreparedDevice] | Exception]:
        self.given.append(list(claims))
        if self.broken:
            raise RuntimeError("a bug")
        return {c.uid: ValueError("no such device") if c is FAILING else [DEVICE] for c in claims}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        self.given.append(list(claims))
        return {c.uid: "" for c in claims}


async def test_the_driver_is_given_only_claims_that_pass_the_checks_and_each_is_answered() -> None:
    driver = Driver()
    service = DraService(driver, Metrics())
    answers = await service.prepare([GOOD, HOSTILE, FAILING])
    assert driver.given == [[GOOD, FAILING]]
    assert answers[GOOD.uid] == [DEVICE]
    assert answers[FAILING.uid] == "no such device"
    assert "not a Kubernetes UID" in str(answers[HOSTILE.uid])
    unprepared = await service.unprepare([HOSTILE, GOOD])
    assert driver.given[-1] == [GOOD]
    assert list(unprepared) == [HOSTILE.uid, GOOD.uid] and unprepared[GOOD.uid] == ""
    assert "not a Kubernetes UID" in unprepared[HOSTILE.uid]


async def test_a_driver_that_raises_answers_each_claim_with_an_internal_error() -> None:
    answers = await DraService(Driver(broken=True), Metrics()).prepare([GOOD, HOSTILE])
    assert answers[GOOD.uid] == "internal error: a bug"
    assert "not a Kubernetes UID" in str(answers[HOSTILE.uid])


async def test_a_call_of_only_bad_claims_never_reaches_the_driver() -> None:
    driver = Driver()
    service = DraService(driver, Metrics())
    await service.prepare([HOSTILE])
    await service.unprepare([HOSTILE])
    assert driver.given == []
