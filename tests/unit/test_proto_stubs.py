"""The committed stubs match the .proto files, and the .proto files match the kubelet's wire format."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import gen_proto  # noqa: E402


def test_committed_stubs_are_up_to_date(tmp_path: Path) -> None:
    written = gen_proto.generate(tmp_path)
    assert written, "no .proto files found"
    stale = [
        str(path.relative_to(tmp_path)) for path in written
        if (ROOT / "src" / path.relative_to(tmp_path)).read_bytes() != path.read_bytes()
    ]
    assert not stale, f"stubs differ from their .proto files; run `make proto`: {stale}"


# (message, field, number, repeated) from the Device Plugin API v1beta1 tables.
FIELDS = [
    ("DevicePluginOptions", "pre_start_required", 1, False),
    ("DevicePluginOptions", "get_preferred_allocation_available", 2, False),
    ("RegisterRequest", "version", 1, False),
    ("RegisterRequest", "endpoint", 2, False),
    ("RegisterRequest", "resource_name", 3, False),
    ("RegisterRequest", "options", 4, False),
    ("ListAndWatchResponse", "devices", 1, True),
    ("TopologyInfo", "nodes", 1, True),
    ("NUMANode", "ID", 1, False),
    ("Device", "ID", 1, False),
    ("Device", "health", 2, False),
    ("Device", "topology", 3, False),
    ("PreStartContainerRequest", "devices_ids", 1, True),
    ("PreferredAllocationRequest", "container_requests", 1, True),
    ("ContainerPreferredAllocationRequest", "available_deviceIDs", 1, True),
    ("ContainerPreferredAllocationRequest", "must_include_deviceIDs", 2, True),
    ("ContainerPreferredAllocationRequest", "allocation_size", 3, False),
    ("PreferredAllocationResponse", "container_responses", 1, True),
    ("ContainerPreferredAllocationResponse", "deviceIDs", 1, True),
    ("AllocateRequest", "container_requests", 1, True),
    ("ContainerAllocateRequest", "devices_ids", 1, True),
    ("CDIDevice", "name", 1, False),
    ("AllocateResponse", "container_responses", 1, True),
    ("ContainerAllocateResponse", "envs", 1, True),
    ("ContainerAllocateResponse", "mounts", 2, True),
    ("ContainerAllocateResponse", "devices", 3, True),
    ("ContainerAllocateResponse", "annotations", 4, True),
    ("ContainerAllocateResponse", "cdi_devices", 5, True),
    ("Mount", "container_path", 1, False),
    ("Mount", "host_path", 2, False),
    ("Mount", "read_only", 3, False),
    ("DeviceSpec", "container_path", 1, False),
    ("DeviceSpec", "host_path", 2, False),
    ("DeviceSpec", "permissions", 3, False),
]


@pytest.mark.parametrize(("message", "name", "number", "repeated"), FIELDS)
def test_field_numbers(message: str, name: str, number: int, repeated: bool) -> None:
    descriptor = pb.DESCRIPTOR.message_types_by_name[message]
    field = descriptor.fields_by_name[name]
    assert field.number == number
    assert field.is_repeated is repeated


def test_every_field_is_checked() -> None:
    checked = {(m, f) for m, f, _, _ in FIELDS}
    declared = {
        (name, field.name)
        for name, message in pb.DESCRIPTOR.message_types_by_name.items()
        for field in message.fields
    }
    assert declared == checked


def test_services_and_paths() -> None:
    assert pb.DESCRIPTOR.package == "v1beta1"
    services = {s.full_name: [m.name for m in s.methods] for s in pb.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "v1beta1.Registration": ["Register"],
        "v1beta1.DevicePlugin": [
            "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate", "PreStartContainer"
        ],
    }
    list_and_watch = pb.DESCRIPTOR.services_by_name["DevicePlugin"].methods_by_name["ListAndWatch"]
    assert list_and_watch.server_streaming is True


from gpuppetti._proto.dra.v1 import api_pb2 as dra_v1  # noqa: E402
from gpuppetti._proto.dra.v1beta1 import api_pb2 as dra_v1beta1  # noqa: E402
from gpuppetti._proto.drahealth.v1alpha1 import api_pb2 as dra_health  # noqa: E402
from gpuppetti._proto.pluginregistration.v1 import api_pb2 as registration  # noqa: E402

DRA_FIELDS = [
    ("NodePrepareResourcesRequest", "claims", 1, True),
    ("NodePrepareResourcesResponse", "claims", 1, True),
    ("NodePrepareResourceResponse", "devices", 1, True),
    ("NodePrepareResourceResponse", "error", 2, False),
    ("Device", "request_names", 1, True),
    ("Device", "pool_name", 2, False),
    ("Device", "device_name", 3, False),
    ("Device", "cdi_device_ids", 4, True),
    ("NodeUnprepareResourcesRequest", "claims", 1, True),
    ("NodeUnprepareResourcesResponse", "claims", 1, True),
    ("NodeUnprepareResourceResponse", "error", 1, False),
    ("Claim", "namespace", 1, False),
    ("Claim", "uid", 2, False),
    ("Claim", "name", 3, False),
]


@pytest.mark.parametrize("module", [dra_v1, dra_v1beta1], ids=["v1", "v1beta1"])
@pytest.mark.parametrize(("message", "name", "number", "repeated"), DRA_FIELDS)
def test_dra_field_numbers(module: object, message: str, name: str, number: int, repeated: bool) -> None:
    field = module.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]  # type: ignore[attr-defined]
    assert (field.number, field.is_repeated) == (number, repeated)


def test_dra_versions_differ_only_in_share_id() -> None:
    v1_device = dra_v1.DESCRIPTOR.message_types_by_name["Device"]
    share = v1_device.fields_by_name["share_id"]
    assert share.number == 5 and share.has_presence
    assert "share_id" not in dra_v1beta1.DESCRIPTOR.message_types_by_name["Device"].fields_by_name
    assert dra_v1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert dra_v1beta1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1beta1"
    for module in (dra_v1, dra_v1beta1):
        declared = {(n, f.name) for n, m in module.DESCRIPTOR.message_types_by_name.items() for f in m.fields}
        assert declared - {("Device", "share_id")} == {(m, f) for m, f, _, _ in DRA_FIELDS}


@pytest.mark.parametrize(("message", "name", "number", "repeated"), [
    ("PluginInfo", "type", 1, False),
    ("PluginInfo", "name", 2, False),
    ("PluginInfo", "endpoint", 3, False),
    ("PluginInfo", "supported_versions", 4, True),
    ("RegistrationStatus", "plugin_registered", 1, False),
    ("RegistrationStatus", "error", 2, False),
])
def test_registration_field_numbers(message: str, name: str, number: int, repeated: bool) -> None:
    field = registration.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]
    assert (field.number, field.is_repeated) == (number, repeated)
    assert registration.DESCRIPTOR.package == "pluginregistration"


def test_health_api() -> None:
    assert dra_health.DESCRIPTOR.package == "v1alpha1"
    assert dict(dra_health.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
    fields = {f.name: f.number for f in dra_health.DESCRIPTOR.message_types_by_name["DeviceHealth"].fields}
    assert fields == {"device": 1, "health": 2, "last_updated_time": 3, "health_check_timeout_seconds": 4,
                      "message": 5}
    method = dra_health.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods_by_name["NodeWatchResources"]
    assert method.server_streaming


from gpuppetti._proto.cri.v1 import api_pb2 as cri  # noqa: E402

CRI_FIELDS = [
    ("VersionRequest", "version", 1),
    ("VersionResponse", "version", 1),
    ("VersionResponse", "runtime_name", 2),
    ("VersionResponse", "runtime_version", 3),
    ("VersionResponse", "runtime_api_version", 4),
    ("StatusRequest", "verbose", 1),
    ("RuntimeCondition", "type", 1),
    ("RuntimeCondition", "status", 2),
    ("RuntimeCondition", "reason", 3),
    ("RuntimeCondition", "message", 4),
    ("RuntimeStatus", "conditions", 1),
    ("StatusResponse", "status", 1),
    ("StatusResponse", "info", 2),
]


def test_the_cri_subset_is_wire_compatible_with_runtime_v1() -> None:
    assert cri.DESCRIPTOR.package == "runtime.v1"
    for message, name, number in CRI_FIELDS:
        assert cri.DESCRIPTOR.message_types_by_name[message].fields_by_name[name].number == number, (message, name)
    declared = {(m.name, f.name) for m in cri.DESCRIPTOR.message_types_by_name.values() for f in m.fields}
    assert declared == {(m, f) for m, f, _ in CRI_FIELDS}
    methods = cri.DESCRIPTOR.services_by_name["RuntimeService"].methods_by_name
    assert sorted(methods) == ["Status", "Version"]


from gpuppetti._proto.podresources.v1 import api_pb2 as podresources  # noqa: E402

PODRESOURCES_FIELDS = [
    ("ListPodResourcesResponse", "pod_resources", 1),
    ("PodResources", "name", 1),
    ("PodResources", "namespace", 2),
    ("PodResources", "containers", 3),
    ("ContainerResources", "name", 1),
    ("ContainerResources", "devices", 2),
    ("ContainerDevices", "resource_name", 1),
    ("ContainerDevices", "device_ids", 2),
]


def test_the_podresources_subset_is_wire_compatible_with_v1() -> None:
    assert podresources.DESCRIPTOR.package == "v1"
    for message, name, number in PODRESOURCES_FIELDS:
        field = podresources.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]
        assert field.number == number, (message, name)
    declared = {(m.name, f.name) for m in podresources.DESCRIPTOR.message_types_by_name.values() for f in m.fields}
    assert declared == {(m, f) for m, f, _ in PODRESOURCES_FIELDS}
    assert list(podresources.DESCRIPTOR.services_by_name["PodResourcesLister"].methods_by_name) == ["List"]
