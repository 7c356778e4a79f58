from __future__ import annotations

import pytest

from gpuppetti.core import cdi
from gpuppetti.core.model import ContainerEdits, DeviceNode, Mount
from tests.cdi_checks import spec_problems


def _edits() -> ContainerEdits:
    return ContainerEdits(env={"A": "1"}, device_nodes=[DeviceNode("/dev/dri/renderD128")])


def test_lowest_version_for_what_is_used() -> None:
    assert cdi.build_spec("vendor.com/gpu", [("gpu0", _edits())])["cdiVersion"] == "0.3.0"
    # A device name that starts with a digit (a claim UID, say) needs 0.5.0.
    assert cdi.build_spec("vendor.com/gpu", [("0abc", _edits())])["cdiVersion"] == "0.5.0"
    with_host_path = ContainerEdits(device_nodes=[DeviceNode("/dev/x", host_path="/dev/y")])
    assert cdi.build_spec("vendor.com/gpu", [("gpu0", with_host_path)])["cdiVersion"] == "0.5.0"
    assert cdi.build_spec("vendor.com/gpu.x", [("gpu0", _edits())])["cdiVersion"] == "0.6.0"


def test_rendered_edits() -> None:
    edits = _edits()
    edits.add_mount(Mount("/run/x", "/run/x", read_only=False))
    rendered = cdi.render_edits(edits)
    assert rendered == {
        "env": ["A=1"],
        "deviceNodes": [{"path": "/dev/dri/renderD128", "permissions": "rw"}],
        "mounts": [{"hostPath": "/run/x", "containerPath": "/run/x", "options": ["rw", "nosuid", "nodev", "bind"]}],
    }


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda s: s.update(cdiVersion="9.9.9"), "not a known version"),
        (lambda s: s.update(kind="novendor"), "is not vendor/class"),
        (lambda s: s.update(kind="vendor.com/g"), "must be 2-63"),
        (lambda s: s["devices"][0].update(name="bad name"), "is not valid"),
        (lambda s: s["devices"].append(dict(s["devices"][0])), "used twice"),
        (lambda s: s["devices"][0]["containerEdits"].update(env=["novalue"]), "not KEY=VALUE"),
        (lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(path="dev/x"), "not absolute"),
        (lambda s: s.update(devices=[]), "at least one device"),
        (lambda s: s["devices"][0].update(name="0gpu"), "lower than its fields need"),
    ],
)
def test_spec_problems(change: object, problem: str) -> None:
    spec = cdi.build_spec("vendor.com/gpu", [("gpu0", _edits())])
    assert spec_problems(spec) == []
    change(spec)  # type: ignore[operator]
    assert any(problem in p for p in spec_problems(spec)), spec_problems(spec)


def test_file_names() -> None:
    assert cdi.spec_filename("gpu.gpuppetti.dev/gpu") == "gpu.gpuppetti.dev-gpu.json"
    assert cdi.spec_filename("gpu.gpuppetti.dev/gpu", "uid-1") == "gpu.gpuppetti.dev-gpu_uid-1.json"
