"""Prefill-decode disaggregation, the worker's half: the KV store and its transports."""
