#!/bin/sh
# Build llama.cpp's Vulkan backend (its `llama-simple` example, statically linked against llama and ggml) for the
# application tests in tests/apps, into a cache directory outside the repository.
#
#   tools/build-llama-vulkan.sh            # ~17 minutes on 2 cores; a second run that finds it built does nothing
#
# The source is llama.cpp as vendored in llama-cpp-python's sdist on PyPI (no GitHub needed). It needs cmake, a C++
# compiler, the Vulkan headers and loader, SPIR-V headers and glslc (Debian 12: apt-get install cmake g++
# libvulkan-dev spirv-headers glslc).
#
# Environment:
#   GPUPPETTI_LLAMA_CPP_DIR   where it builds (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuppetti/apps/llama.cpp)
#   LLAMA_CPP_PYTHON_VERSION  the llama-cpp-python sdist whose vendor/llama.cpp is built (default below)
#   PYTHON                    the Python whose pip downloads the sdist (default: the repository's .venv, else python3)
#   JOBS                      parallel compile jobs (default: the number of CPUs)
#
# What it leaves: $DIR/bin/llama-simple and $DIR/version (the sdist's version; the tests report it). Everything it
# downloads and unpacks stays under $DIR.
set -eu

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=${GPUPPETTI_LLAMA_CPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuppetti/apps/llama.cpp}
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
SDIST=llama_cpp_python-$VERSION
SRC=$DIR/src/$SDIST/vendor/llama.cpp
BUILD=$DIR/build-$VERSION

say() { echo "build-llama-vulkan: $*"; }

if [ -x "$DIR/bin/llama-simple" ] && [ "$(cat "$DIR/version" 2>/dev/null)" = "$VERSION" ]; then
    say "already built: $DIR/bin/llama-simple (llama-cpp-python $VERSION); remove $DIR to build again"
    exit 0
fi

missing=""
for tool in cmake c++ glslc; do
    command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"
done
[ -f /usr/include/vulkan/vulkan.hpp ] || missing="$missing vulkan.hpp(libvulkan-dev)"
[ -d /usr/share/cmake/SPIRV-Headers ] || [ -d /usr/lib/cmake/SPIRV-Headers ] || missing="$missing spirv-headers"
if [ -n "$missing" ]; then
    say "missing:$missing (Debian 12: apt-get install cmake g++ libvulkan-dev spirv-headers glslc)" >&2
    exit 1
fi

mkdir -p "$DIR/src" "$DIR/bin"

if [ ! -f "$DIR/src/$SDIST.tar.gz" ]; then
    say "downloading the llama-cpp-python $VERSION sdist from PyPI into $DIR/src"
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps -d "$DIR/src" "llama-cpp-python==$VERSION"
fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    say "unpacking $SDIST.tar.gz"
    rm -rf "${DIR:?}/src/$SDIST"
    tar -xzf "$DIR/src/$SDIST.tar.gz" -C "$DIR/src"
fi

# Debian 12's Vulkan headers (1.3.239) predate VK_EXT_layer_settings (1.3.261), which ggml-vulkan uses in one
# spot: to turn on the validation layer's best-practice checks when that layer is installed. Where the headers lack
# the extension, that spot falls back to creating the instance without the settings (no best-practice checks; the
# validation layer itself, if present, is still loaded). Applied to the unpacked copy only, once.
say "patching ggml-vulkan.cpp for Vulkan headers without VK_EXT_layer_settings (if needed)"
"$PYTHON" - "$SRC/ggml/src/ggml-vulkan/ggml-vulkan.cpp" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
marker = "/* gpuppetti: VK_EXT_layer_settings guard */"
if marker in text:
    print("build-llama-vulkan: already patched")
    sys.exit(0)
start = text.index("    VkBool32 enable_best_practice = layer_settings;")
end_line = "vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions, &layer_setting_info);\n"
end = text.index(end_line, start) + len(end_line)
original = text[start:end]
replacement = (f"{marker}\n#if defined(VK_EXT_layer_settings)\n{original}#else\n"
               "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions);\n"
               "#endif\n")
open(path, "w").write(text[:start] + replacement + text[end:])
print("build-llama-vulkan: patched the instance creation (VK_EXT_layer_settings is optional now)")
EOF

# Static (llama-simple loads nothing of llama.cpp at run time: the test image copies one file), not tuned to this
# CPU (ggml's x86-64 default: AVX2), no network code, only the example the tests run.
say "configuring in $BUILD (Vulkan on, static, llama-simple only)"
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_COMMON=ON

say "building llama-simple with $JOBS jobs (the Vulkan shaders take most of the time)"
start=$(date +%s)
cmake --build "$BUILD" --target llama-simple -j "$JOBS"
say "built in $(( $(date +%s) - start )) s"

cp "$BUILD/bin/llama-simple" "$DIR/bin/llama-simple.tmp"
mv "$DIR/bin/llama-simple.tmp" "$DIR/bin/llama-simple"
echo "$VERSION" > "$DIR/version"
say "done: $DIR/bin/llama-simple (llama-cpp-python $VERSION's llama.cpp, Vulkan backend)"
