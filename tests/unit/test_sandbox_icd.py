"""The sandbox's lavapipe is this machine's own, where another architecture's manifest is installed beside it."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from gpuppetti.kubelet import sandbox


@pytest.mark.parametrize("names", [
    ["lvp_icd.aarch64.json", f"lvp_icd.{platform.machine()}.json", "lvp_icd.x86_64.json"],
    ["lvp_icd.riscv64.json", "lvp_icd.json", "lvp_icd.s390x.json"],
])
def test_this_machines_lavapipe_is_chosen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, names: list[str]) -> None:
    loader = tmp_path / "libvulkan.so.1"
    loader.write_text("")
    for name in names:
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(sandbox, "VULKAN_LOADER", loader)
    monkeypatch.setattr(sandbox, "ICD_DIR", tmp_path)
    assert sandbox.vulkan_icd() == tmp_path / names[1]


def test_only_another_architectures_lavapipe_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loader = tmp_path / "libvulkan.so.1"
    loader.write_text("")
    (tmp_path / "lvp_icd.riscv64.json").write_text("{}")
    monkeypatch.setattr(sandbox, "VULKAN_LOADER", loader)
    monkeypatch.setattr(sandbox, "ICD_DIR", tmp_path)
    assert sandbox.vulkan_icd() is None
