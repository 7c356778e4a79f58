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
