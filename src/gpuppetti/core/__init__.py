"""The data everything else speaks: the GPU model, the versioned config, CDI specs and the Kubernetes objects the
drivers write, as plain typed data with no I/O."""
