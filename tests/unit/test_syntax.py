"""What the code takes as a name, an id or a quantity means what it says: Python's `$` matches before a final
newline, so every pattern tried with `match` took a value with one (a claim UID, a namespace, an allocation id)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuppetti.base.quantity import parse_duration, parse_quantity
from gpuppetti.base.syntax import (
    dns_label_problem,
    dns_subdomain_problem,
    host_path_problem,
    image_problem,
    label_key_problem,
    label_value_problem,
)
from gpuppetti.core.config import resource_name_problem
from gpuppetti.kit.draplugin import ClaimRef, claim_problem
from gpuppetti.layer.vulkan import LayerDir, Record

UID = "0b7c6f8e-4a8e-4c55-9b3a-2f9d1e6c7a10"


@pytest.mark.parametrize(("check", "good"), [
    (dns_label_problem, "gpuppetti"),
    (dns_subdomain_problem, "node-1.example"),
    (image_problem, "registry.example/gpuppetti:0.1.0"),
    (label_key_problem, "kubernetes.io/arch"),
    (label_value_problem, "amd64"),
    (resource_name_problem, "apple.com/gpu"),
])
def test_a_trailing_newline_is_no_part_of_a_name(check: object, good: str) -> None:
    assert callable(check)
    assert check(good) is None
    assert check(good + "\n") is not None


@pytest.mark.parametrize("claim", [ClaimRef("default", UID + "\n", "claim"), ClaimRef("default\n", UID, "claim")])
def test_a_claim_uid_or_namespace_with_a_newline_is_refused(claim: ClaimRef) -> None:
    assert claim_problem(ClaimRef("default", UID, "claim")) is None
    assert claim_problem(claim) is not None


def test_an_allocation_id_with_a_newline_makes_no_record(tmp_path: Path) -> None:
    layer = LayerDir(tmp_path)
    with pytest.raises(ValueError, match="not an allocation id"):
        layer.write_record("alloc-1\n", Record(["gpu-0::0"], []))
    assert layer.read_records() == {}


def test_quantities_and_durations_take_their_own_spaces_only() -> None:
    # The config's YAML may leave spaces around a value, which parsing forgives; nothing else follows the suffix.
    assert parse_quantity(" 48Gi\n") == 48 * 2**30
    assert parse_duration("5s\n") == 5.0
    with pytest.raises(ValueError):
        parse_quantity("48Gi\nx")


@pytest.mark.parametrize(("path", "ok"), [("/var/lib/gpuppetti", True), ("/", True), ("relative", False),
                                          ("/a/../etc", False), ("/a\n", False), ("/a\tb", False)])
def test_a_host_path(path: str, ok: bool) -> None:
    assert (host_path_problem(path) is None) == ok
