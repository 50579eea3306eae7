"""MemoryEventLog events and JSON output; process_rss_bytes."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memory import MemoryEventLog, process_rss_bytes


def test_record_keeps_given_fields_and_omits_unset_ones() -> None:
    timeline = MemoryEventLog()
    before_s = time.time()
    timeline.record("sleep", phase="begin", tag="weights", num_bytes=4096, level=1)
    timeline.record("note")
    first, second = timeline.events
    assert first == {
        "time_s": first["time_s"],
        "event": "sleep",
        "phase": "begin",
        "tag": "weights",
        "num_bytes": 4096,
        "level": 1,
    }
    assert before_s <= first["time_s"] <= second["time_s"] <= time.time()
    assert second == {"time_s": second["time_s"], "event": "note"}


def test_events_is_a_copy_and_clear_empties() -> None:
    timeline = MemoryEventLog()
    timeline.record("a")
    timeline.events.clear()
    assert len(timeline.events) == 1
    timeline.clear()
    assert timeline.events == []


def test_span_records_begin_end_and_errors() -> None:
    timeline = MemoryEventLog()
    with timeline.span("wake", tag="kv_cache"):
        pass
    with pytest.raises(ValueError), timeline.span("wake", tag="weights"):
        raise ValueError("boom")
    phases = [(event["tag"], event["phase"]) for event in timeline.events]
    assert phases == [
        ("kv_cache", "begin"),
        ("kv_cache", "end"),
        ("weights", "begin"),
        ("weights", "error"),
    ]
    assert "boom" in timeline.events[-1]["error"] and timeline.events[1]["duration_s"] >= 0


def test_to_json_round_trips(tmp_path: Path) -> None:
    timeline = MemoryEventLog()
    timeline.record("sleep", tag="weights", num_bytes=1)
    path = tmp_path / "timeline.json"
    timeline.to_json(path)
    written = json.loads(path.read_text())
    assert written == {"pid": os.getpid(), "events": timeline.events}


def test_process_rss_bytes_of_this_and_other_processes() -> None:
    own_bytes = process_rss_bytes()
    assert own_bytes == pytest.approx(process_rss_bytes(os.getpid()), rel=0.1)
    assert own_bytes > 10 << 20  # an interpreter with torch loaded
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert process_rss_bytes(child.pid) > 0
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ProcessLookupError):
        process_rss_bytes(child.pid)  # reaped: no /proc entry any more
