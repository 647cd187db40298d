"""gRPC clients for the Triton-hosted workers."""
