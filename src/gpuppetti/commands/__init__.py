"""Commands that are not daemons: the demo, the manifests and the chart's source, and ``gpuppetti top``."""
