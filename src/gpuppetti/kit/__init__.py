"""The kubelet-plugin kit: what both front ends need to serve the kubelet, written once, in the shape of the Go
drivers' kubeletplugin helper and ResourceSlice controller: a gRPC server on a Unix socket of ours (endpoint),
registration with the kubelet both ways it knows (registration), a pool's ResourceSlices kept published
(publisher), the DRA services around a driver's prepare and unprepare callbacks (draplugin), and a DRA plugin
started whole from them (kubeletplugin). It imports none of the node's services: the daemons pass in what it needs
of them, as the protocols of seams. The front ends (deviceplugin/, dra/) are the drivers: what they serve, and what
their pools hold."""
