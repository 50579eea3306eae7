"""The wire schema (rollout.proto) and its generated gRPC stubs."""
