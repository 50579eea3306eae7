"""Sampling on the device: logits processing, top-k/top-p/min-p filters, the sampler, the
rejection sampler of speculative decoding, per-request random streams and prompt logprobs."""
