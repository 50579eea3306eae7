"""Torch-free bookkeeping: requests, the token-ledger scheduler, KV blocks, n-gram drafting."""
