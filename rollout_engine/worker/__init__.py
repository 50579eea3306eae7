"""The device side: the model, its KV cache and weights in tagged pools, the model runner."""
