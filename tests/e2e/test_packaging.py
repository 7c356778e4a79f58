"""What users install carries the Vulkan layer: the wheel `pip wheel .` and the Dockerfile build, and the wheel built
from the sdist, each from a clean clone of HEAD; and a build that cannot make the layer fails when it is required."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.packaging import (
    NATIVE,
    clean_clone,
    members,
    only,
    pip_wheel,
    sdist_then_wheel,
    venv_with,
    wheel_tag,
    why_no_build,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = why_no_build()
    if reason is not None:
        pytest.skip(f"the package cannot be built from a clean clone here: {reason}")
    return clean_clone(tmp_path_factory.mktemp("clone") / "gpuppetti")


def assert_carries_layer(wheel: Path) -> None:
    listed = members(wheel)
    for name in NATIVE:
        assert name in listed, f"{wheel.name} lacks {name}: {sorted(n for n in listed if '_native' in n)}"
        assert listed[name].size > 1000
        assert listed[name].mode & 0o111, f"{name} is not executable in {wheel.name}"
    # Native code for this platform, but no Python ABI: nothing in the package links libpython.
    tag = wheel_tag(wheel)
    assert tag.startswith("py3-none-linux_"), tag


# Data the package reads beside its code: the demo's built-in configs.
DATA = ("gpuppetti/commands/demo/configs/demo.yaml", "gpuppetti/commands/demo/configs/sandbox.yaml")


def assert_carries_data(wheel: Path) -> None:
    listed = members(wheel)
    assert not [name for name in DATA if name not in listed], f"{wheel.name} lacks some of {DATA}"


def test_pip_wheel_from_a_clean_clone_carries_the_layer(clean_wheel: Path) -> None:
    assert_carries_layer(clean_wheel)
    assert_carries_data(clean_wheel)


def test_the_layer_links_no_libpython(clean_wheel: Path, tmp_path: Path) -> None:
    import zipfile
    with zipfile.ZipFile(clean_wheel) as archive:
        archive.extractall(tmp_path)
    for name in NATIVE:
        needed = subprocess.run(["readelf", "-d", str(tmp_path / name)], capture_output=True, text=True, check=True)
        assert "NEEDED" in needed.stdout
        assert "libpython" not in needed.stdout, needed.stdout


def test_the_sdist_carries_the_source_and_its_wheel_the_layer(clone: Path, tmp_path: Path) -> None:
    result = sdist_then_wheel(clone, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    with tarfile.open(only(tmp_path, "gpuppetti-*.tar.gz")) as sdist:
        names = sdist.getnames()
    assert any(name.endswith("native/vulkan-layer/layer.c") for name in names)
    assert any(name.endswith("native/vulkan-layer/Makefile") for name in names)
    # Never a built copy: the wheel's layer is compiled from the sdist's source.
    assert not [name for name in names if name.endswith(".so") or "/_native/" in name]
    assert_carries_layer(only(tmp_path, "gpuppetti-*.whl"))
    assert_carries_data(only(tmp_path, "gpuppetti-*.whl"))


def test_a_required_layer_that_cannot_be_built_fails_the_build(clone: Path, tmp_path: Path) -> None:
    result = pip_wheel(clone, tmp_path, env={"CC": "/bin/false"})
    assert result.returncode != 0
    assert "building the Vulkan layer failed" in result.stdout + result.stderr
    assert not list(tmp_path.glob("*.whl"))


def test_the_installed_wheel_delivers_the_layer(clean_wheel: Path, tmp_path: Path) -> None:
    """Installed into a fresh venv, as a user installs it: the daemons find the layer and install it."""
    env = venv_with(clean_wheel, tmp_path / "venv", compile=False)
    python = env / "bin" / "python"
    script = ("import sys; from pathlib import Path; from gpuppetti.layer.vulkan import LayerDir; "
              "LayerDir(Path(sys.argv[1])).install()")
    layer_dir = tmp_path / "layer"
    subprocess.run([str(python), "-c", script, str(layer_dir)], check=True, capture_output=True, timeout=60)
    assert (layer_dir / "libVkLayer_gpuppetti.so").stat().st_size > 1000
    assert (layer_dir / "VkLayer_gpuppetti.json").exists()
    probe = subprocess.run([str(layer_dir / "gpuppetti-vkinfo"), "--help"], capture_output=True, text=True,
                           timeout=30, check=False)
    assert probe.returncode == 0, probe.stderr


def test_the_layer_is_built_without_make(clone: Path, tmp_path: Path) -> None:
    """`pip install .` where make is not installed: setup.py compiles the two targets with the compiler alone."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "make").write_text("#!/bin/sh\necho 'make: not installed here' >&2\nexit 127\n")
    (shims / "make").chmod(0o755)
    result = pip_wheel(clone, tmp_path / "out", env={"PATH": f"{shims}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert_carries_layer(only(tmp_path / "out", "gpuppetti-*.whl"))


def test_setup_compiles_what_the_makefile_would() -> None:
    """One place holds the flags and sources: setup.py reads the Makefile's, and runs the very lines make runs."""
    import setup

    out = Path("/nonexistent/out")
    shown = subprocess.run(["make", "--no-print-directory", "-n", "-B", "-C", str(setup.NATIVE_SOURCE), f"OUT={out}",
                            "CC=cc", "CFLAGS=-O2"], capture_output=True, text=True, timeout=60, check=True)
    compiles = [line for line in shown.stdout.splitlines() if line.startswith("cc ")]
    ours = [shlex.join(command) for command, _ in setup.compile_commands(out, cc=["cc"], cflags=["-O2"])]
    assert compiles == ours


def test_without_a_compiler_the_install_succeeds_and_the_package_says_why(clone: Path, tmp_path: Path) -> None:
    """pip hides the build's warning: the installed package says it when the plugin starts, and doctor the fix."""
    result = pip_wheel(clone, tmp_path / "out", env={"GPUPPETTI_REQUIRE_LAYER": "0", "CC": "/nonexistent/cc"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    wheel = only(tmp_path / "out", "gpuppetti-*.whl")
    assert not set(NATIVE) & set(members(wheel))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(site)}
    why = "no C compiler '/nonexistent/cc'"

    node = tmp_path / "node"
    plugin = subprocess.Popen([sys.executable, "-m", "gpuppetti", "plugin", "--backend", "simulated",
                               "--device-plugin-dir", str(node / "dp"), "--cdi-dir", str(node / "cdi"),
                               "--vulkan-layer-dir", str(node / "vulkan"), "--http-address", "127.0.0.1:0"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert plugin.stderr is not None
        said: list[str] = []
        for line in plugin.stderr:
            said.append(line)
            if "slices are not enforced" in line:
                break
    finally:
        plugin.terminate()
        plugin.wait(timeout=30)
    [warning] = [line for line in said if "slices are not enforced" in line]
    assert why in warning and str(site) in warning and "C compiler and libvulkan-dev" in warning

    doctor = subprocess.run([sys.executable, "-m", "gpuppetti", "doctor", "--backend", "simulated",
                             "--vulkan-layer-dir", str(node / "vulkan"), "--json"],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    [check] = [c for c in json.loads(doctor.stdout) if c["check"] == "Vulkan layer"]
    assert why in check["detail"], check
    assert "pip install --force-reinstall" in check["fix"], check
