# gpuppetti: one image for `gpuppetti plugin` and `gpuppetti dra`.
# Build: make image   (podman or docker build -t localhost/gpuppetti:dev .), the image the manifests run.
#
# The container runs as root because the kubelet's sockets and directories (device-plugins, plugins_registry,
# plugins, /var/run/cdi) belong to root on the node; the manifests drop every capability, forbid privilege
# escalation and mount the root filesystem read-only.

FROM python:3.11-slim-bookworm AS build
# The Vulkan layer and its probe are C, compiled into the wheel (setup.py); the image must have them.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev make libvulkan-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY src ./src
COPY native ./native
ENV GPUPPETTI_REQUIRE_LAYER=1
RUN python -m pip install --no-cache-dir --upgrade pip \
 && python -m pip wheel --no-cache-dir --wheel-dir /wheels '.[nvml]'

FROM python:3.11-slim-bookworm
# pci.ids names AMD and Intel models from their PCI ids.
RUN apt-get update \
 && apt-get install -y --no-install-recommends pci.ids \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir --no-index /wheels/* && rm -rf /wheels \
 && python -c 'import sys, gpuppetti.node.vulkanlayer as v; m = [n for n in (v.LIBRARY, v.PROBE) if not (v.BUILT / n).is_file()]; sys.exit(f"the image lacks the Vulkan layer: {m}" if m else 0)'
ENV PYTHONUNBUFFERED=1
EXPOSE 9400
ENTRYPOINT ["gpuppetti"]
CMD ["plugin", "--help"]
