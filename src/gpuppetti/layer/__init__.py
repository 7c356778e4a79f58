"""What the daemons install on the node to hold slices: the Vulkan layer's files and directories (vulkan), and the
program the container runtime runs to set a container's dmem limit (dmem_hook)."""
