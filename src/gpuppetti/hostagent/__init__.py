"""The macOS host agent (server) and the plugin's client for it."""

API_PATH = "/v1/gpus"
