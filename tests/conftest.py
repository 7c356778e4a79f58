# The DRA test bench's fixture (`cluster`) serves both the end-to-end and the fault tests.
pytest_plugins = ["tests.dra_support"]
