"""The kubelet-plugin kit: what both front ends need to serve the kubelet, written once (in the shape of the Go
drivers' kubeletplugin helper): a gRPC server on a Unix socket of ours."""
