"""What the cluster's version and feature gates allow of the DRA driver's features: one line each, from the API
server's own gates where its /metrics may be read, else from the release in which each is on by default."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpuppetti.commands.doctor.result import Result, ok, skip, warn
from gpuppetti.node.kube import ApiError, ConfigError, ServerFacts, load_config, server_facts

CHECK = "cluster"
TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Feature:
    check: str
    # The Kubernetes feature gates it needs, on every component.
    gates: tuple[str, ...]
    # The first release in which they are all on by default.
    since: tuple[int, int]
    # How a user sees it work.
    see: str


FEATURES = (
    Feature("claim status", ("DRAResourceClaimDeviceStatus",), (1, 33),
            "kubectl get resourceclaim CLAIM -o yaml (status.devices)"),
    Feature("device health in pod status", ("ResourceHealthStatus",), (1, 36),
            "kubectl get pod POD -o jsonpath='{.status.containerStatuses[*].allocatedResourcesStatus}'"),
    Feature("plain limits through DRA", ("DRAExtendedResource",), (1, 36),
            "kubectl get pod POD -o jsonpath='{.status.extendedResourceClaimStatus}'"),
    Feature("consumable shares and partitions", ("DRAConsumableCapacity",), (1, 36),
            "kubectl get resourceslices -o yaml (allowMultipleAllocations)"),
    Feature("partitions in the counters layout", ("DRAPartitionableDevices",), (1, 36),
            "kubectl get resourceslices -o yaml (sharedCounters)"),
)


async def cluster_checks(kubeconfig: Path | None, mode: str) -> list[Result]:
    if mode == "plugin":
        return [skip(CHECK, "the device plugin's node: the DRA features are not checked")]
    try:
        config = load_config(kubeconfig)
    except ConfigError as exc:
        if kubeconfig is None:
            return [skip(CHECK, "no --kubeconfig given and no in-cluster service account: the cluster's version "
                                "and feature gates are not checked")]
        return [warn(CHECK, f"cannot configure the API client: {exc}", "give a readable --kubeconfig")]
    try:
        facts = await server_facts(config, TIMEOUT_S)
    except ApiError as exc:
        return [warn(CHECK, str(exc), "is the API server up, and does the kubeconfig's account reach it?")]
    return [ok(CHECK, _about(facts)), *(feature_check(feature, facts) for feature in FEATURES)]


def _about(facts: ServerFacts) -> str:
    if facts.gates is not None:
        return f"Kubernetes {facts.version}; its feature gates read from the API server's /metrics"
    return (f"Kubernetes {facts.version}; its feature gates are assumed to be their defaults: {facts.gates_problem} "
            "(an account with get on the non-resource URL /metrics lets doctor read them)")


def feature_check(feature: Feature, facts: ServerFacts) -> Result:
    check = f"{CHECK}: {feature.check}"
    release = ".".join(map(str, feature.since))
    if facts.gates is not None and feature.gates:
        off = [gate for gate in feature.gates if not facts.gates.get(gate, False)]
        if off:
            return warn(check, f"{', '.join(off)} off on the API server",
                        f"turn on the feature gate {', '.join(off)} on the API server, scheduler, controller "
                        "manager and kubelets")
        return ok(check, f"{', '.join(feature.gates)} on; see it: {feature.see}")
    if facts.release is None:
        return warn(check, f"the version {facts.version!r} says no release", f"needs Kubernetes {release} or later")
    if facts.release < feature.since:
        gates = f" (or the feature gate {', '.join(feature.gates)} turned on)" if feature.gates else ""
        return warn(check, f"needs Kubernetes {release} or later{gates}", f"upgrade to Kubernetes {release}")
    on = f"{', '.join(feature.gates)} on by default from {release}" if feature.gates else f"from {release}"
    return ok(check, f"{on}; see it: {feature.see}")
