# gpuppetti: one image for `gpuppetti plugin` and `gpuppetti dra`, for linux/amd64 and linux/arm64.
# Build: make image   (podman or docker build -t localhost/gpuppetti:dev .), the image the manifests run;
#        make image PLATFORMS=linux/amd64,linux/arm64   (one manifest list holding both).
#
# Nothing runs in the target's architecture, so an x86 machine builds the arm64 image without emulation: the build
# stage runs on the build platform, cross-compiles the Vulkan layer and its probe for the target (setup.py, with
# the target's gcc), and fetches the target's wheels of the dependencies (pip --platform); the final stage only
# copies them onto the base.
#
# BASE_IMAGE: the target's Python (PYTHON_VERSION, glibc at least BASE_GLIBC); BUILD_IMAGE: a Debian (bookworm) of
# the build platform with python3 and pip. The build stage installs with apt-get what BUILD_IMAGE lacks (the target's
# gcc, libvulkan-dev for the target, pci.ids); PIP_OPTIONS is added to its pip commands (`--no-index --find-links
# DIR` where no index can be reached).
#
# The container runs as root because the kubelet's sockets and directories (device-plugins, plugins_registry,
# plugins, /var/run/cdi) belong to root on the node; the manifests drop every capability, forbid privilege
# escalation and mount the root filesystem read-only.

ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm
ARG BUILD_IMAGE=docker.io/library/python:3.11-slim-bookworm

FROM --platform=$BUILDPLATFORM ${BUILD_IMAGE} AS build
ARG TARGETARCH
ARG PYTHON_VERSION=3.11
ARG BASE_GLIBC=2.36
ARG PIP_OPTIONS=""
# The target's GNU architecture, and what the build image lacks to build for it.
RUN set -e; \
    case "$TARGETARCH" in amd64) arch=x86_64 ;; arm64) arch=aarch64 ;; \
      *) echo "the image is built for linux/amd64 and linux/arm64, not $TARGETARCH" >&2; exit 1 ;; esac; \
    echo "$arch" > /target-arch; \
    missing=""; \
    if [ "$(dpkg --print-architecture)" = "$TARGETARCH" ]; then \
      command -v "$arch-linux-gnu-gcc" >/dev/null || missing="$missing gcc libc6-dev"; \
    else \
      command -v "$arch-linux-gnu-gcc" >/dev/null \
        || missing="$missing gcc-$(echo $arch | tr _ -)-linux-gnu libc6-dev-$TARGETARCH-cross"; \
    fi; \
    [ -f /usr/include/vulkan/vulkan.h ] && [ -f "/usr/lib/$arch-linux-gnu/libvulkan.so" ] \
      || missing="$missing libvulkan-dev:$TARGETARCH"; \
    [ -f /usr/share/misc/pci.ids ] || missing="$missing pci.ids"; \
    if [ -n "$missing" ]; then \
      dpkg --add-architecture "$TARGETARCH"; \
      apt-get update; \
      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing; \
      rm -rf /var/lib/apt/lists/*; \
    fi
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md LICENSE ./
COPY src ./src
COPY native ./native
# The package, its layer and probe compiled for the target (the layer required), then every dependency as the
# target's wheels (manylinux up to the base's glibc), into /opt/gpuppetti, a `gpuppetti` command, and pci.ids (which
# names AMD and Intel models from their PCI ids): what the final stage copies. A Debian python3's pip installs
# --target only, never into that Python.
ENV GPUPPETTI_REQUIRE_LAYER=1 PIP_BREAK_SYSTEM_PACKAGES=1
RUN set -e; arch=$(cat /target-arch); \
    CC="$arch-linux-gnu-gcc" python3 -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels $PIP_OPTIONS .; \
    platforms="--platform linux_$arch --platform manylinux2014_$arch"; \
    n=17; while [ "$n" -le "${BASE_GLIBC#2.}" ]; do platforms="$platforms --platform manylinux_2_${n}_$arch"; \
      n=$((n + 1)); done; \
    python3 -m pip install --no-cache-dir --no-compile --target /out/opt/gpuppetti --only-binary=:all: \
      --implementation cp --python-version "$PYTHON_VERSION" $platforms $PIP_OPTIONS \
      "$(ls /wheels/gpuppetti-*.whl)[nvml]"; \
    rm -rf /out/opt/gpuppetti/bin; \
    for name in libVkLayer_gpuppetti.so gpuppetti-vkinfo; do \
      file="/out/opt/gpuppetti/gpuppetti/_native/$name"; \
      [ -f "$file" ] || { echo "the image lacks the Vulkan layer: $name" >&2; exit 1; }; \
    done; \
    mkdir -p /out/usr/local/bin /out/usr/share/misc; \
    printf '#!/bin/sh\nexec python3 -m gpuppetti "$@"\n' > /out/usr/local/bin/gpuppetti; \
    chmod 755 /out/usr/local/bin/gpuppetti; \
    cp /usr/share/misc/pci.ids /out/usr/share/misc/pci.ids

# The target's base (a registry's image, or a local manifest list, is resolved for the target platform).
FROM --platform=$TARGETPLATFORM ${BASE_IMAGE}
COPY --from=build /out/ /
ENV PYTHONPATH=/opt/gpuppetti PYTHONUNBUFFERED=1
EXPOSE 9400
ENTRYPOINT ["gpuppetti"]
CMD ["plugin", "--help"]
