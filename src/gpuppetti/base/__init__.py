"""The ground floor: small tools every other part may use (quantities, strict parsing, atomic files, backoff, the
process runtime, HTTP and gRPC helpers). They know nothing of GPUs, Kubernetes or the front ends."""
