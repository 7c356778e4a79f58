"""The package build compiles the Vulkan layer and its probe (native/vulkan-layer) into gpuppetti/_native.

Everything else is in pyproject.toml. Where no C compiler or Vulkan headers are installed the package is built
without them, saying so (slices are then not enforced), unless GPUPPETTI_REQUIRE_LAYER=1 makes that an error,
as the Dockerfile does.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
NATIVE_SOURCE = ROOT / "native" / "vulkan-layer"
# What the layer's build must leave in the package (src/gpuppetti/node/vulkanlayer.py reads these names).
NATIVE_FILES = ("libVkLayer_gpuppetti.so", "gpuppetti-vkinfo")


class BuildWithLayer(build_py):
    def run(self) -> None:
        super().run()
        # Absolute: make runs in the layer's source directory, where a relative build_lib names another place.
        out = (Path(self.build_lib) / "gpuppetti" / "_native").resolve()
        result = subprocess.run(["make", "-C", str(NATIVE_SOURCE), f"OUT={out}"], check=False)
        missing = [name for name in NATIVE_FILES if not (out / name).is_file()]
        if result.returncode == 0 and not missing:
            return
        why = f"make exited {result.returncode}" if result.returncode != 0 else f"{', '.join(missing)} not built"
        if os.environ.get("GPUPPETTI_REQUIRE_LAYER") == "1":
            raise SystemExit(f"building the Vulkan layer failed ({why}; it needs a C compiler and libvulkan-dev)")
        print(f"warning: the Vulkan layer was not built ({why}); slices will not be enforced")


class NativeDistribution(Distribution):
    # The layer and its probe are native code for this platform: the wheel is a platform wheel, installed to platlib.
    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    # Nothing in the package links libpython or uses a Python ABI: one wheel serves every Python 3 on the platform.
    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(cmdclass={"build_py": BuildWithLayer, "bdist_wheel": PlatformWheel}, distclass=NativeDistribution)
