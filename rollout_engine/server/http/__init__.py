"""`vllm serve`'s HTTP API (`serve --http-port`): the OpenAI-compatible endpoints, tokenize and
detokenize, metrics, and the RL control endpoints, over the gRPC server's `AsyncEngine`.

Only `rollout_engine.server.serve` imports this package (when an HTTP port is asked for), so a
gRPC-only server never loads FastAPI.
"""
