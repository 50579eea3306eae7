"""Tensor parallelism: rank 0's driver, the other ranks' processes and loop, and their group."""
