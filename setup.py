"""The package build compiles the Vulkan layer and its probe (native/vulkan-layer) into gpuppetti/_native.

Everything else is in pyproject.toml. The two C targets are compiled here with the compiler alone (``CC``, default
cc; no make needed), from the flags and sources that native/vulkan-layer/Makefile names: that Makefile is the one
place that holds them. ``CC`` may be a cross compiler (``CC=aarch64-linux-gnu-gcc``): the wheel is then tagged for
the architecture the compiler targets. Where no C compiler or Vulkan headers are installed the package is built
without the layer, saying so (slices are then not enforced, and the installed package says so when a command that
would enforce them starts), unless GPUPPETTI_REQUIRE_LAYER=1 makes that an error, as `make dist` and the image do.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent
NATIVE_SOURCE = ROOT / "native" / "vulkan-layer"
# What the layer's build must leave in the package (src/gpuppetti/layer/vulkan.py reads these names).
LIBRARY = "libVkLayer_gpuppetti.so"
PROBE = "gpuppetti-vkinfo"
NATIVE_FILES = (LIBRARY, PROBE)
# Where the layer was not built, why: the installed package says it when a command that would enforce slices starts
# (pip shows no build output unless asked to).
NOT_BUILT = "NOT_BUILT"

# The Makefile's variables that make up the two compile lines (its $(LAYER) and $(PROBE) rules).
_ASSIGNMENT = re.compile(r"^([A-Z_]+)\s*(?::=|\?=|=)\s*(.*)$")
_REFERENCE = re.compile(r"\$\(([A-Z_]+)\)")


class BuildFlagsError(Exception):
    """The Makefile's variables cannot be read as plain assignments."""


def makefile_variables(makefile: Path = NATIVE_SOURCE / "Makefile") -> dict[str, str]:
    """The Makefile's top-level assignments of upper-case variables, each expanded from the ones before it."""
    variables: dict[str, str] = {}
    for line in makefile.read_text(encoding="utf-8").splitlines():
        match = _ASSIGNMENT.match(line)
        if match is None:
            continue
        name, value = match.groups()
        variables[name] = _REFERENCE.sub(lambda ref: variables.get(ref.group(1), ref.group(0)), value.strip())
    return variables


def compile_commands(out: Path, cc: list[str] | None = None, cflags: list[str] | None = None,
                     makefile: Path = NATIVE_SOURCE / "Makefile") -> list[tuple[list[str], Path]]:
    """The layer's and the probe's compile lines, as the Makefile runs them in native/vulkan-layer with OUT=out,
    each with the file it writes (then renamed to drop .tmp)."""
    variables = makefile_variables(makefile)
    needed = ("CFLAGS", "WARNINGS", "HARDENING", "LAYER_FLAGS", "THREADS", "LAYER_SOURCES", "PROBE_SOURCES",
              "PROBE_LIBS")
    missing = [name for name in needed if name not in variables]
    unexpanded = [name for name in needed if "$" in variables.get(name, "")]
    if missing or unexpanded:
        raise BuildFlagsError(f"{makefile}: {', '.join(missing + unexpanded)} not a plain assignment")

    def flags(name: str) -> list[str]:
        return shlex.split(variables[name])

    cc = cc if cc is not None else shlex.split(os.environ.get("CC") or "cc")
    cflags = cflags if cflags is not None else shlex.split(os.environ.get("CFLAGS") or variables["CFLAGS"])
    common = [*cc, *cflags, *flags("WARNINGS"), *flags("HARDENING")]
    layer, probe = out / f"{LIBRARY}.tmp", out / f"{PROBE}.tmp"
    return [
        ([*common, *flags("LAYER_FLAGS"), "-o", str(layer), *flags("LAYER_SOURCES"), *flags("THREADS")], layer),
        ([*common, "-o", str(probe), *flags("PROBE_SOURCES"), *flags("PROBE_LIBS")], probe),
    ]


def target_machine() -> str | None:
    """The architecture CC compiles for (``x86_64``, ``aarch64``), or None where there is no such compiler."""
    cc = shlex.split(os.environ.get("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        return None
    try:
        result = subprocess.run([*cc, "-dumpmachine"], capture_output=True, text=True, timeout=60, check=False)
    except OSError:
        return None
    machine = result.stdout.strip().split("-")[0]
    return machine if result.returncode == 0 and machine else None


def build_native(out: Path) -> str | None:
    """Compile the layer and its probe into out; None once both are there, else why not."""
    try:
        commands = compile_commands(out)
    except BuildFlagsError as exc:
        return str(exc)
    # A build directory kept from an earlier build must not hand on that build's layer, or its reason for lacking one.
    for name in (*NATIVE_FILES, NOT_BUILT):
        (out / name).unlink(missing_ok=True)
    compiler = commands[0][0][0]
    if shutil.which(compiler) is None:
        return f"no C compiler {compiler!r}"
    out.mkdir(parents=True, exist_ok=True)
    for command, written in commands:
        print(shlex.join(command))
        try:
            result = subprocess.run(command, cwd=NATIVE_SOURCE, check=False, timeout=300)
        except OSError as exc:
            return f"{compiler} did not run: {exc}"
        if result.returncode != 0:
            return f"{compiler} exited {result.returncode} building {written.name.removesuffix('.tmp')}"
        written.replace(written.with_suffix(""))
    return None


if __name__ == "__main__":
    from setuptools import setup
    from setuptools.command.bdist_wheel import bdist_wheel
    from setuptools.command.build_py import build_py
    from setuptools.dist import Distribution

    class BuildWithLayer(build_py):
        def run(self) -> None:
            super().run()
            out = Path(self.build_lib).resolve() / "gpuppetti" / "_native"
            why = build_native(out)
            if why is None and not (missing := [name for name in NATIVE_FILES if not (out / name).is_file()]):
                return
            why = why or f"{', '.join(missing)} not built"
            if os.environ.get("GPUPPETTI_REQUIRE_LAYER") == "1":
                raise SystemExit(f"building the Vulkan layer failed ({why}; it needs a C compiler and libvulkan-dev)")
            print(f"warning: the Vulkan layer was not built ({why}); slices will not be enforced")
            out.mkdir(parents=True, exist_ok=True)
            (out / NOT_BUILT).write_text(why + "\n", encoding="utf-8")

    class NativeDistribution(Distribution):
        # The layer and its probe are native code: the wheel is a platform wheel, installed to platlib.
        def has_ext_modules(self) -> bool:
            return True

    class PlatformWheel(bdist_wheel):
        # Nothing in the package links libpython or uses a Python ABI: one wheel serves every Python 3 on the
        # platform, the one CC compiles for (a cross compiler's, where CC names one).
        def get_tag(self) -> tuple[str, str, str]:
            _, _, plat = super().get_tag()
            machine = target_machine()
            if machine is not None and machine != platform.machine() and plat.startswith("linux_"):
                plat = f"linux_{machine}"
            return "py3", "none", plat

    setup(cmdclass={"build_py": BuildWithLayer, "bdist_wheel": PlatformWheel}, distclass=NativeDistribution)
