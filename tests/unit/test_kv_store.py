"""The prefill side's store of saved KV: entries expire on their own, on an idle store too, by a
thread that sleeps between expiries and stops when the store is closed or collected."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path

import torch

from rollout_engine.worker.cpu_threads import cpu_seconds
from rollout_engine.worker.kv_transfer.kv_connector_worker import KVStore


def started_threads(action) -> list[threading.Thread]:
    """The threads `action()` started."""
    before = set(threading.enumerate())
    action()
    return [t for t in threading.enumerate() if t not in before]


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_entries_expire_with_nothing_else_called(tmp_path: Path) -> None:
    store = KVStore(ttl_s=0.1)
    path = tmp_path / "kv"
    path.write_bytes(b"kv")
    store.put_file(str(path))
    store.put_tensor("t", torch.zeros(4))
    try:
        assert wait_until(lambda: not path.exists() and store.num_entries == 0, 2.0)
    finally:
        store.close()


def test_the_expiry_thread_sleeps_while_waiting_and_stops_at_close(tmp_path: Path) -> None:
    store = KVStore(ttl_s=60.0)
    path = tmp_path / "kv"
    path.write_bytes(b"kv")
    (thread,) = started_threads(lambda: store.put_file(str(path)))
    stat_path = f"/proc/self/task/{thread.native_id}/stat"
    cpu_before_s = cpu_seconds(stat_path)
    time.sleep(0.3)
    assert cpu_seconds(stat_path) - cpu_before_s < 0.05, "the expiry thread polls"
    assert path.exists(), "expired an hour early"
    store.close()
    assert not thread.is_alive() and not path.exists()


def test_a_store_nobody_closed_stops_its_thread_when_collected(tmp_path: Path) -> None:
    store = KVStore(ttl_s=60.0)
    path = tmp_path / "kv"
    path.write_bytes(b"kv")
    weak_store = weakref.ref(store)  # the test itself must not keep the store alive
    (thread,) = started_threads(lambda: weak_store().put_file(str(path)))
    del store
    gc.collect()
    thread.join(timeout=2.0)
    assert not thread.is_alive() and not path.exists()
