"""Everything under deploy/ validates against the Kubernetes schemas, and the examples fit the driver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpuppetti.config import DraSection
from gpuppetti.dra import opaque

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
FILES = sorted(DEPLOY.rglob("*.yaml"))
VERSIONS = ("1.34", "1.35", "1.36")


def _objects(path: Path) -> list[dict[str, Any]]:
    return [obj for obj in yaml.safe_load_all(path.read_text()) if obj]


@pytest.mark.parametrize("path", [p for p in FILES if p.name != "kustomization.yaml"], ids=lambda p: p.name)
@pytest.mark.parametrize("version", VERSIONS)
def test_validates(path: Path, version: str) -> None:
    objects = _objects(path)
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_validation_really_rejects_bad_objects() -> None:
    [device_class, _] = _objects(DEPLOY / "dra" / "deviceclass.yaml")
    device_class["spec"]["selector"] = device_class["spec"].pop("selectors")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(device_class, "1.34", strict=True)


def test_kustomization_lists_every_file_beside_it() -> None:
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        listed = set(yaml.safe_load(kustomization.read_text())["resources"])
        present = {p.name for p in kustomization.parent.glob("*.yaml")} - {"kustomization.yaml"}
        assert listed == present, kustomization


def test_device_class_selects_the_default_driver() -> None:
    [every, _] = _objects(DEPLOY / "dra" / "deviceclass.yaml")
    assert every["metadata"]["name"] == DraSection().driver_name
    assert f"'{DraSection().driver_name}'" in every["spec"]["selectors"][0]["cel"]["expression"]


def test_example_gpu_config_decodes() -> None:
    [template] = _objects(DEPLOY / "dra" / "examples" / "shared-gpu.yaml")
    [entry] = template["spec"]["spec"]["devices"]["config"]
    config = opaque.decode(entry["opaque"]["parameters"], "example")
    assert config.sharing.strategy == "TimeSlicing"
