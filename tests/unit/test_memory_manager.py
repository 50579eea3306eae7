"""MemoryManager on CPU: the sleep/wake state machine, contents, addresses and errors."""

from collections.abc import Iterator

import pytest
import torch

from memory import MemoryEventLog, MemoryManager, MemoryStateError, TagState, UnknownTagError

WEIGHTS_BYTES = 1 << 20
KV_BYTES = 2 << 20


@pytest.fixture
def manager() -> Iterator[MemoryManager]:
    with MemoryManager("cpu") as manager:
        manager.create_pool("weights", WEIGHTS_BYTES)
        manager.create_pool("kv_cache", KV_BYTES)
        yield manager


def fill_random(manager: MemoryManager, tag: str) -> torch.Tensor:
    """Fill a whole pool with random bytes; returns a copy of them."""
    pool_bytes = manager.pool(tag).as_bytes()  # [num_bytes] uint8
    pool_bytes.copy_(torch.randint(0, 256, pool_bytes.shape, dtype=torch.uint8))
    return pool_bytes.clone()


def test_new_pools_are_awake_and_mapped(manager: MemoryManager) -> None:
    assert manager.tags() == ["weights", "kv_cache"]
    for tag in manager.tags():
        assert manager.state(tag) is TagState.AWAKE and manager.is_mapped(tag)
        assert manager.pool(tag).is_mapped


def test_offload_restores_contents_bit_exact_at_the_same_address(manager: MemoryManager) -> None:
    weight = manager.pool("weights").allocate((256, 512), torch.bfloat16)  # [256, 512]
    expected = fill_random(manager, "weights")
    ptrs = (manager.pool("weights").data_ptr, weight.data_ptr())
    manager.sleep("weights", offload=True)
    assert manager.state("weights") is TagState.OFFLOADED and not manager.is_mapped("weights")
    manager.wake("weights")
    assert manager.state("weights") is TagState.AWAKE and manager.is_mapped("weights")
    assert (manager.pool("weights").data_ptr, weight.data_ptr()) == ptrs
    assert torch.equal(manager.pool("weights").as_bytes(), expected)
    assert manager.memory_state()["tags"]["weights"]["backup_bytes"] == 0


def test_discard_comes_back_zeroed_and_needs_mark_valid(manager: MemoryManager) -> None:
    kv = manager.pool("kv_cache").allocate((2, 64, 1024), torch.float32)  # [2, num_slots, dim]
    kv.fill_(3.0)
    ptr = kv.data_ptr()
    manager.sleep("kv_cache", offload=False)
    assert manager.state("kv_cache") is TagState.DISCARDED and not manager.is_mapped("kv_cache")
    manager.wake("kv_cache")
    assert manager.state("kv_cache") is TagState.DISCARDED and manager.is_mapped("kv_cache")
    assert kv.data_ptr() == ptr and not kv.any()
    manager.mark_valid("kv_cache")
    assert manager.state("kv_cache") is TagState.AWAKE


def test_tags_sleep_and_wake_independently(manager: MemoryManager) -> None:
    weights = fill_random(manager, "weights")
    fill_random(manager, "kv_cache")
    manager.sleep("kv_cache", offload=False)
    assert manager.state("weights") is TagState.AWAKE
    assert torch.equal(manager.pool("weights").as_bytes(), weights)
    manager.sleep("weights", offload=True)
    manager.wake("weights")
    assert manager.state("kv_cache") is TagState.DISCARDED and not manager.is_mapped("kv_cache")
    manager.wake("kv_cache")
    assert not manager.pool("kv_cache").as_bytes().any()


def test_sleeping_a_sleeping_tag_keeps_its_state(manager: MemoryManager) -> None:
    expected = fill_random(manager, "weights")
    manager.sleep("weights", offload=True)
    manager.sleep("weights", offload=False)  # no-op: the backup is kept
    assert manager.state("weights") is TagState.OFFLOADED
    manager.wake("weights")
    assert torch.equal(manager.pool("weights").as_bytes(), expected)
    manager.sleep("kv_cache", offload=False)
    manager.sleep("kv_cache", offload=True)  # no-op: nothing left to offload
    assert manager.state("kv_cache") is TagState.DISCARDED


def test_waking_an_awake_tag_is_a_no_op(manager: MemoryManager) -> None:
    expected = fill_random(manager, "weights")
    manager.wake("weights")
    assert manager.state("weights") is TagState.AWAKE
    assert torch.equal(manager.pool("weights").as_bytes(), expected)


def test_offloading_a_mapped_discarded_tag_releases_it_without_backup(
    manager: MemoryManager,
) -> None:
    manager.mark_invalid("weights")
    manager.sleep("weights", offload=True)
    assert manager.state("weights") is TagState.DISCARDED and not manager.is_mapped("weights")
    assert manager.memory_state()["tags"]["weights"]["backup_bytes"] == 0


def test_mark_invalid_while_mapped_then_valid_again(manager: MemoryManager) -> None:
    manager.mark_invalid("weights")
    assert manager.state("weights") is TagState.DISCARDED and manager.is_mapped("weights")
    manager.mark_invalid("weights")  # idempotent
    manager.mark_valid("weights")
    manager.mark_valid("weights")  # idempotent
    assert manager.state("weights") is TagState.AWAKE


def test_mark_invalid_drops_an_offloaded_backup(manager: MemoryManager) -> None:
    fill_random(manager, "weights")
    manager.sleep("weights", offload=True)
    manager.mark_invalid("weights")
    assert manager.state("weights") is TagState.DISCARDED
    assert manager.memory_state()["tags"]["weights"]["backup_bytes"] == 0
    manager.wake("weights")
    assert manager.state("weights") is TagState.DISCARDED
    assert not manager.pool("weights").as_bytes().any()


@pytest.mark.parametrize("offload", [True, False])
def test_mark_valid_needs_a_wake_first(manager: MemoryManager, offload: bool) -> None:
    manager.sleep("weights", offload=offload)
    with pytest.raises(MemoryStateError, match=r"call wake\('weights'\)") as info:
        manager.mark_valid("weights")
    assert "not mapped" in str(info.value)


def test_unknown_tag_names_the_known_ones(manager: MemoryManager) -> None:
    for operation in (manager.pool, manager.state, manager.wake, manager.mark_valid):
        with pytest.raises(UnknownTagError) as info:
            operation("kv")
        assert str(info.value) == "unknown memory tag 'kv'; known tags: ['kv_cache', 'weights']"
        assert isinstance(info.value, MemoryStateError) and isinstance(info.value, KeyError)
    with pytest.raises(MemoryStateError, match="unknown memory tag 'kv'"):
        manager.sleep("kv", offload=True)


def test_create_pool_rejects_duplicates_and_bad_sizes(manager: MemoryManager) -> None:
    with pytest.raises(MemoryStateError, match=r"already has a pool.*free_pool\('weights'\)"):
        manager.create_pool("weights", 1024)
    for bad_size in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive int"):
            manager.create_pool("other", bad_size)  # type: ignore[arg-type]
    assert manager.tags() == ["weights", "kv_cache"]


def test_free_pool_then_create_again(manager: MemoryManager) -> None:
    manager.sleep("kv_cache", offload=True)
    manager.free_pool("kv_cache")
    assert manager.tags() == ["weights"]
    pool = manager.create_pool("kv_cache", 4096)
    assert pool.num_bytes == 4096 and manager.state("kv_cache") is TagState.AWAKE


def test_closed_manager_refuses_every_operation() -> None:
    manager = MemoryManager("cpu")
    manager.create_pool("weights", 4096)
    manager.close()
    manager.close()  # idempotent
    with pytest.raises(MemoryStateError, match="closed"):
        manager.state("weights")
    with pytest.raises(MemoryStateError, match="closed"):
        manager.create_pool("kv_cache", 4096)


def test_memory_state_reports_each_tag(manager: MemoryManager) -> None:
    manager.pool("kv_cache").allocate((100,), torch.float32)
    manager.sleep("weights", offload=True)
    state = manager.memory_state()
    assert state["device"] == "cpu" and state["process_rss_bytes"] > 0
    assert state["tags"]["weights"] == {
        "state": "offloaded",
        "mapped": False,
        "bytes": WEIGHTS_BYTES,
        "allocated_bytes": 0,
        "backup_bytes": WEIGHTS_BYTES,
        "spare_backup_bytes": 0,
    }
    assert state["tags"]["kv_cache"]["state"] == "awake"
    assert state["tags"]["kv_cache"]["allocated_bytes"] == 400
    assert "device_used_bytes" not in state


def test_transitions_are_recorded_on_the_timeline() -> None:
    timeline = MemoryEventLog()
    with MemoryManager("cpu", event_log=timeline) as manager:
        manager.create_pool("weights", 8192)
        manager.sleep("weights", offload=True)
        manager.wake("weights")
        manager.mark_invalid("weights")
        manager.mark_valid("weights")
    steps = [(event["event"], event.get("phase")) for event in timeline.events]
    assert steps == [
        ("create_pool", "begin"),
        ("create_pool", "end"),
        ("sleep", "begin"),
        ("sleep", "end"),
        ("wake", "begin"),
        ("wake", "end"),
        ("mark_invalid", None),
        ("mark_valid", None),
        ("free_pool", "begin"),
        ("free_pool", "end"),
    ]
    sleep_end = timeline.events[3]
    assert sleep_end["tag"] == "weights" and sleep_end["num_bytes"] == 8192
    assert sleep_end["offload"] is True and sleep_end["duration_s"] >= 0


def test_a_backend_that_keeps_host_backups_allocates_one_per_tag() -> None:
    """The CUDA backend keeps its pinned backup across sleep(level=1) cycles (allocating it is
    the slow part of a wake); the manager logic is checked here with a CPU backend told to."""
    from memory import cpu_backend

    allocations = []

    class CountingBackup(cpu_backend.CpuHostBackup):
        def __init__(self, num_bytes: int) -> None:
            allocations.append(num_bytes)
            super().__init__(num_bytes)

    with MemoryManager("cpu") as keeping:
        keeping._backend.keeps_host_backups = True  # the CUDA policy, on the CPU
        original = cpu_backend.CpuHostBackup
        cpu_backend.CpuHostBackup = CountingBackup
        try:
            pool = keeping.create_pool("weights", 1 << 20)
            data = pool.allocate((1 << 18,), torch.float32)
            for cycle in range(5):
                data.fill_(cycle)
                keeping.sleep("weights", offload=True)
                keeping.wake("weights")
                assert bool((data == cycle).all())
                assert keeping.memory_state()["tags"]["weights"]["spare_backup_bytes"] == 1 << 20
        finally:
            cpu_backend.CpuHostBackup = original
    assert allocations == [1 << 20]
