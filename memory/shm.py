"""Shared-memory files (/dev/shm) that carry bytes between processes on one host: the
trainer's weight buckets, the prefill engine's KV. Both sides name them; this is where they
live and how they are removed."""

from __future__ import annotations

import os
from collections.abc import Iterable

SHM_DIR = "/dev/shm"


def unlink_all(paths: Iterable[str]) -> None:
    """Remove these files; ones already gone (read and removed by the peer, expired) are fine."""
    for path in list(paths):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
