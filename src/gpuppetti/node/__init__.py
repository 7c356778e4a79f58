"""The node's services, shared by every front end: discovery into the inventory, health monitoring, metrics, the
Vulkan layer's directories, node labels and reports, and the one client of the API server."""
