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
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


class BuildWithLayer(build_py):
    def run(self) -> None:
        super().run()
        out = Path(self.build_lib) / "gpuppetti" / "_native"
        result = subprocess.run(["make", "-C", str(ROOT / "native" / "vulkan-layer"), f"OUT={out}"], check=False)
        if result.returncode != 0:
            if os.environ.get("GPUPPETTI_REQUIRE_LAYER") == "1":
                raise SystemExit("building the Vulkan layer failed (needs a C compiler and libvulkan-dev)")
            print("warning: the Vulkan layer was not built; slices will not be enforced")


class PlatformDistribution(Distribution):
    # The layer is a native library: the wheel is for this platform.
    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildWithLayer}, distclass=PlatformDistribution)
