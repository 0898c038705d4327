"""A committed batch is wholly visible, an aborted one not at all; markers take an offset (W1)."""

from __future__ import annotations

import pytest

from tests.integration.helpers import payloads, replay_all, writer
from tests.waiting import wait_until
from wal import OffsetMismatchError, Replayer
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka


def test_committed_batches_are_whole_and_upcoming_offsets_count_markers(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    expected_payloads: list[bytes] = []
    upcoming = w.fence()
    for size in (1, 5, 2, 17):
        batch = [f"{size}-{i}".encode() for i in range(size)]
        result = w.append(batch)
        assert result.offsets == tuple(range(upcoming, upcoming + size))
        assert result.upcoming_offset == upcoming + size + 1  # the commit marker takes one offset
        # The partition agrees once the marker is written (asynchronously, after commit returns).
        wait_until(lambda r=result: w.end_offset() == r.upcoming_offset, 10,
                   what=f"the commit marker in the high watermark ({result.upcoming_offset})")
        upcoming = result.upcoming_offset
        expected_payloads += batch

    records, _ = replay_all(kafka.bootstrap_servers, topic)
    assert payloads(records) == expected_payloads
    # Offsets are not contiguous: each batch is followed by its marker.
    assert [r.offset for r in records][:2] == [0, 2]
    w.close()


def test_aborted_batch_is_invisible(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    end_before = w.append([b"kept"]).upcoming_offset
    with pytest.raises(OffsetMismatchError):
        w.append([b"x1", b"x2", b"x3"], expected_offset=end_before + 1)
    # The records and the abort marker are in the log, read_committed never shows them.
    wait_until(lambda: w.end_offset() == end_before + 3 + 1, 10, what="the abort marker in the high watermark")
    assert w.stats.aborts == 1
    records, _ = replay_all(kafka.bootstrap_servers, topic)
    assert payloads(records) == [b"kept"]
    with Replayer(kafka.bootstrap_servers, topic, 0, end_before) as tail:
        assert list(tail.read_to_end(10)) == []
        assert tail.position == end_before + 4
    w.close()
