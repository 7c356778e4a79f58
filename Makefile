# The two commands of the quick start: `make demo` and `make test`. Each creates .venv when needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The image the manifests run by default; podman where it is installed, else docker.
IMAGE ?= localhost/gpuppetti:dev
CONTAINER_TOOL ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)

# The Vulkan layer and its probe, built into the package (native/vulkan-layer).
NATIVE_OUT := src/gpuppetti/_native
NATIVE := $(NATIVE_OUT)/libVkLayer_gpuppetti.so $(NATIVE_OUT)/gpuppetti-vkinfo
NATIVE_SRC := $(wildcard native/vulkan-layer/*.c native/vulkan-layer/*.h) native/vulkan-layer/Makefile

.PHONY: help demo test unit e2e lint typecheck proto deploy image bench bench-scale bench-compare clean native dist gpu-check venus
.DEFAULT_GOAL := help

# Plain `make`: what there is to make.
help:
	@echo "make demo        the demo: a kubelet emulator, the device plugin and pods on this machine's GPUs"
	@echo "make test        lint, typecheck and every test (about 15 minutes on two cores)"
	@echo "make unit        the unit tests only (about 25 s)"
	@echo "make e2e         the end-to-end tests"
	@echo "make lint        ruff and the import contracts"
	@echo "make typecheck   mypy, strict"
	@echo "make native      the Vulkan layer and its probe, into the package"
	@echo "make dist        an sdist and a wheel per architecture ($(DIST_ARCHES)) in dist/"
	@echo "make image       the image the manifests run ($(IMAGE))"
	@echo "make deploy      re-render deploy/ from gpuppetti manifests"
	@echo "make proto       regenerate the gRPC stubs"
	@echo "make bench       the benchmark suite; make bench-scale: DRA at cluster scale (root)"
	@echo "make bench-compare REV=<commit>   the daemons' figures for REV and this checkout, in one run"
	@echo "make venus       the Venus tier (root); make gpu-check: on a host with a real GPU"
	@echo "make clean       every build output"

$(STAMP): pyproject.toml
	@echo "installing gpuppetti and its dependencies into $(VENV) (first run, or pyproject.toml changed: about a minute)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Without a C compiler or the Vulkan headers everything else still works: slices are then not enforced.
native: $(NATIVE)
$(NATIVE) &: $(NATIVE_SRC)
	@if command -v $${CC:-cc} >/dev/null && [ -f /usr/include/vulkan/vulkan.h ]; then \
	  $(MAKE) -C native/vulkan-layer OUT=$(abspath $(NATIVE_OUT)); \
	else \
	  echo "note: the Vulkan layer is not built (needs a C compiler and libvulkan-dev): slices are not enforced"; \
	fi

demo: $(STAMP) native
	$(BIN)/gpuppetti demo
	@echo "(gpuppetti is installed in $(BIN): '. $(BIN)/activate' puts the gpuppetti command on your PATH)"

# Where a test starts daemons as processes of their own, their modules are compiled once here, not in each of them
# (where PYTHONDONTWRITEBYTECODE is set, nothing else would keep the compiled modules).
# Two phases. First every test but the cluster tier, the Venus tier and the tests that time the GPU, in two workers
# (pytest-xdist; worksteal evens out their long tests), while the Venus tier's chroot and applications are made in
# the background (debootstrap and apt: the network and the disk, little CPU). Then, one at a time, the cluster tier
# (one real node per machine) and the tests that time the GPU, beside the Venus tier, whose VMs run mostly alone on
# the second core; its output is kept in a log and printed when it ends. --durations says where the time went.
TEST_WORKERS ?= 2
TEST_LOGS := .test-logs
test: lint typecheck native
	$(BIN)/python -m compileall -q src
	@mkdir -p $(TEST_LOGS)
	@echo "the Venus tier's chroot is prepared in the background ($(TEST_LOGS)/venus-prepare.log)"
	@# The arm64 guest's tree takes about 20 minutes once per machine (dpkg emulated): built in a session of its
	@# own that this target does not wait for; its tests run where it is ready and say so where it is not.
	@setsid $(BIN)/python -m tests.venus.venusnode arm64 > $(TEST_LOGS)/venus-arm64-prepare.log 2>&1 < /dev/null &
	@$(BIN)/python -m tests.venus.venusnode > $(TEST_LOGS)/venus-prepare.log 2>&1 & prepare=$$!; \
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=10 -m "not timed" \
	  --ignore=tests/venus --ignore=tests/cluster; status=$$?; \
	wait $$prepare; cat $(TEST_LOGS)/venus-prepare.log; exit $$status
	@echo "the Venus tier runs beside the serial tests; its output follows theirs ($(TEST_LOGS)/venus.log)"
	@$(BIN)/python -m pytest --durations=10 tests/venus > $(TEST_LOGS)/venus.log 2>&1 & venus=$$!; \
	$(BIN)/python -m pytest --durations=15 -m "(cluster or timed) and not rollout" tests/cluster tests/e2e; serial=$$?; \
	wait $$venus; venus_status=$$?; echo "---- the Venus tier"; cat $(TEST_LOGS)/venus.log; \
	[ $$serial -eq 0 ] && [ $$venus_status -eq 0 ]

unit: $(STAMP) native
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal tests/unit

e2e: $(STAMP) native
	$(BIN)/python -m pytest tests/e2e

lint: $(STAMP)
	$(BIN)/ruff check setup.py src tests tools bench
	$(BIN)/lint-imports --no-logo --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy

deploy: $(STAMP)
	$(BIN)/python tools/gen_deploy.py
	$(BIN)/python tools/gen_chart.py
	$(BIN)/python tools/gen_dashboard.py

# PLATFORMS=linux/amd64,linux/arm64: one manifest list named IMAGE holding an image per platform, each built on this
# machine without emulation (the Dockerfile cross-compiles; podman). IMAGE_BUILD_FLAGS: more of the build's flags
# (--build-arg BASE_IMAGE=..., BUILD_IMAGE=...).
PLATFORMS ?=
IMAGE_BUILD_FLAGS ?=
# Podman 4.3 does not set BUILDPLATFORM, which the build stage runs on: this machine's.
BUILD_PLATFORM ?= linux/$(shell uname -m | sed 's/^x86_64$$/amd64/; s/^aarch64$$/arm64/')
image:
ifeq ($(PLATFORMS),)
	$(CONTAINER_TOOL) build $(IMAGE_BUILD_FLAGS) --build-arg BUILDPLATFORM=$(BUILD_PLATFORM) -t $(IMAGE) .
else
	@case "$(CONTAINER_TOOL)" in *podman*) ;; *) echo "make image PLATFORMS=...: podman builds the manifest list" \
	  "(docker: docker buildx build --platform $(PLATFORMS) -t $(IMAGE) --push .)" >&2; exit 2 ;; esac
	-$(CONTAINER_TOOL) manifest rm $(IMAGE) >/dev/null 2>&1
	$(CONTAINER_TOOL) build $(IMAGE_BUILD_FLAGS) --build-arg BUILDPLATFORM=$(BUILD_PLATFORM) --platform $(PLATFORMS) \
	  --manifest $(IMAGE) .
endif

proto: $(STAMP)
	$(BIN)/python tools/gen_proto.py

# What users install, in dist/: an sdist, and from it one wheel per architecture of DIST_ARCHES, each carrying the layer
# and its probe compiled for that architecture by its $(arch)-linux-gnu-gcc (a cross compiler where it is not this
# machine's: Debian's gcc-aarch64-linux-gnu with libvulkan-dev:arm64). auditwheel then gives each wheel the lowest
# manylinux tag its binaries satisfy (dist/gpuppetti-VERSION-py3-none-manylinux_2_N_ARCH.whl); the probe's
# libvulkan.so.1 is the system's Vulkan loader, never one carried in the wheel.
DIST_ARCHES ?= x86_64 aarch64
# Each architecture's compiler and Vulkan loader are checked before anything is built or removed: Debian names the
# architectures otherwise (x86_64 is amd64, aarch64 arm64), and the loader of another one is a foreign package.
dist: $(STAMP)
	@for arch in $(DIST_ARCHES); do \
	  deb=$$(case $$arch in (x86_64) echo amd64 ;; (aarch64) echo arm64 ;; (*) echo $$arch ;; esac); \
	  command -v $$arch-linux-gnu-gcc >/dev/null || { echo "make dist: no $$arch-linux-gnu-gcc for the $$arch wheel" \
	    "(Debian: apt-get install gcc-$$(echo $$arch | tr _ -)-linux-gnu libvulkan-dev:$$deb)" >&2; exit 1; }; \
	  case "$$($$arch-linux-gnu-gcc -print-file-name=libvulkan.so)" in */*) ;; *) \
	    echo "make dist: $$arch-linux-gnu-gcc finds no libvulkan.so for the $$arch wheel (Debian: dpkg" \
	      "--add-architecture $$deb && apt-get update && apt-get install libvulkan-dev:$$deb)" >&2; exit 1 ;; esac; \
	done
	rm -rf dist
	GPUPPETTI_REQUIRE_LAYER=1 $(BIN)/python -m build --no-isolation --sdist --outdir dist .
	@set -e; for arch in $(DIST_ARCHES); do \
	  echo "building the $$arch wheel from the sdist (CC=$$arch-linux-gnu-gcc)"; \
	  CC=$$arch-linux-gnu-gcc GPUPPETTI_REQUIRE_LAYER=1 $(BIN)/python -m pip wheel --quiet --no-deps \
	    --no-build-isolation --no-cache-dir --wheel-dir dist/linux-$$arch dist/gpuppetti-*.tar.gz; \
	done
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/auditwheel repair --exclude libvulkan.so.1 --wheel-dir dist dist/linux-*/*.whl
	rm -rf dist/linux-*

# Every build output: the venv, caches, the layer (in the package and in its own directory), the package builds.
clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache src/*.egg-info $(NATIVE_OUT) $(TEST_LOGS) \
		native/vulkan-layer/build build dist
	find src tests tools bench -name __pycache__ -type d -prune -exec rm -rf {} +

# The Venus tier: gpuppetti from its wheel in a VM whose GPU is a virtio-gpu driven by Mesa's Venus, as in a krunkit
# VM on an Apple-silicon Mac (../shared/venusnode; root; about 3.5 minutes, plus 2 for the VM's first setup).
# ARCH=arm64: only the arm64 guest, the Mac's own architecture (its tree is built first where it is not: ~20 min).
ARCH ?=
venus: $(STAMP) native
ifeq ($(ARCH),arm64)
	$(BIN)/python -m tests.venus.venusnode arm64
	$(BIN)/python -m pytest -m arm64 tests/venus
else
	$(BIN)/python -m pytest tests/venus
endif

# On a host with a real GPU: discover, doctor, and the layer holding gpuppetti-vkinfo and wgpu to a slice of it.
gpu-check: $(STAMP) native
	$(BIN)/python -m pip install --quiet -e '.[dev,nvml]'
	PYTHONPATH=. $(BIN)/python tools/gpu_check.py

# The daemons start from compiled modules, as an installed package does (where PYTHONDONTWRITEBYTECODE is set, an
# editable install would compile them anew at every start and the figures would count it).
bench: $(STAMP) native
	$(BIN)/python -m compileall -q src
	PYTHONPATH=. $(BIN)/python bench/run.py --json bench/results.json

# Before and after in one run: the figures that must not grow, for REV's daemons (exported from git, its layer
# built) and this checkout's, in interleaved rounds; about 10 minutes, BENCH_COMPARE_ARGS="--rounds 3 --only DRA"
# for less.
REV ?=
bench-compare: $(STAMP) native
	@test -n "$(REV)" || { echo "make bench-compare REV=<commit>: the commit to compare this checkout against" >&2; exit 2; }
	$(BIN)/python -m compileall -q src
	PYTHONPATH=. $(BIN)/python bench/compare.py --against $(REV) --json bench/compare-results.json $(BENCH_COMPARE_ARGS)

# DRA at cluster scale, over the real-node kit (root): 50, 200 and 500 simulated nodes per slicing shape, about
# 25 minutes; BENCH_SCALE_ARGS="--nodes 50 --shapes whole,partitions" for less.
bench-scale: $(STAMP)
	PYTHONPATH=. $(BIN)/python bench/scale.py --json bench/scale-results.json $(BENCH_SCALE_ARGS)
