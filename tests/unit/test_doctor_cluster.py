"""`gpuppetti doctor`'s cluster lines: which of the DRA driver's features the cluster's version and gates allow."""

from __future__ import annotations

from pathlib import Path

from gpuppetti.commands.doctor.cluster import FEATURES, cluster_checks, feature_check
from gpuppetti.commands.doctor.result import Status
from gpuppetti.node.kube import ServerFacts

BRIDGE = next(feature for feature in FEATURES if feature.gates == ("DRAExtendedResource",))
STATUS = next(feature for feature in FEATURES if feature.gates == ("DRAResourceClaimDeviceStatus",))


def test_the_servers_own_gates_win_over_its_version() -> None:
    facts = ServerFacts("v1.36.2", (1, 36), {"DRAExtendedResource": False, "DRAResourceClaimDeviceStatus": True})
    off = feature_check(BRIDGE, facts)
    assert (off.status, off.detail) == (Status.WARN, "DRAExtendedResource off on the API server")
    assert off.fix is not None and "DRAExtendedResource" in off.fix
    on = feature_check(STATUS, facts)
    assert on.status is Status.OK and on.detail.startswith("DRAResourceClaimDeviceStatus on; see it: kubectl get "
                                                           "resourceclaim")


def test_without_the_gates_the_release_says_what_is_on_by_default() -> None:
    old = ServerFacts("v1.34.1", (1, 34), None, "its /metrics answered 403")
    bridge = feature_check(BRIDGE, old)
    assert bridge.status is Status.WARN
    assert bridge.detail == "needs Kubernetes 1.36 or later (or the feature gate DRAExtendedResource turned on)"
    assert feature_check(STATUS, old).detail.startswith("DRAResourceClaimDeviceStatus on by default from 1.33")
    unknown = feature_check(STATUS, ServerFacts("custom", None, None, "its /metrics answered 403"))
    assert unknown.status is Status.WARN and "'custom'" in unknown.detail


async def test_no_cluster_to_ask_is_a_skip_and_a_bad_kubeconfig_a_warning(tmp_path: Path) -> None:
    [plugin] = await cluster_checks(None, "plugin")
    assert plugin.status is Status.SKIP
    (tmp_path / "kubeconfig").write_text("not: [a kubeconfig")
    [bad] = await cluster_checks(tmp_path / "kubeconfig", "dra")
    assert bad.status is Status.WARN and str(tmp_path / "kubeconfig") in bad.detail
