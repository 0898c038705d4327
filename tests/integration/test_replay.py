"""Replay reaches the end even when the partition ends in markers, resumes, and tails."""

from __future__ import annotations

import pytest

from tests.integration.helpers import eventually, payloads, writer
from wal import OffsetMismatchError, Replayer
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka


def test_replay_reaches_end_of_partition_ending_in_commit_marker(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    w.append([b"a", b"b"])
    last = w.append([b"c"])
    with Replayer(kafka.bootstrap_servers, topic, 0, 0) as r:
        assert r.end_offset() == last.upcoming_offset
        assert payloads(list(r.read_to_end(10))) == [b"a", b"b", b"c"]
        assert r.position == last.upcoming_offset  # past the final commit marker
    w.close()


def test_replay_reaches_end_of_partition_ending_in_abort_marker(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    w.append([b"a"])
    with pytest.raises(OffsetMismatchError):
        w.append([b"aborted-1", b"aborted-2"], expected_offset=99)
    end = 2 + 2 + 1  # "a", its marker, two aborted records, the abort marker
    eventually(lambda: w.end_offset() == end, what="abort marker")
    with Replayer(kafka.bootstrap_servers, topic, 0, 0) as r:
        assert payloads(list(r.read_to_end(10))) == [b"a"]
        assert r.position == end
    w.close()


def test_replay_resumes_from_an_offset_and_tails(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    w.append([b"one"])
    second = w.append([b"two", b"three"])
    with Replayer(kafka.bootstrap_servers, topic, 0, second.offsets[0]) as r:
        assert payloads(list(r.read_to_end(10))) == [b"two", b"three"]
        checkpoint = r.position
        w.append([b"four"])
        tailed = r.poll(5.0)
        assert payloads(tailed) == [b"four"]
        r.seek(second.offsets[1])
        assert payloads(list(r.read_to_end(10))) == [b"three", b"four"]
        assert r.position > checkpoint
    w.close()


def test_a_tailing_replayer_moves_past_the_commit_marker_with_the_batch(kafka: LocalKafka, topic: str) -> None:
    """A takeover waits for its standby to pass the old leader's last commit marker. The
    position must move past it with the batch, not one empty fetch later (PARTITION_EOF, which
    the broker holds for fetch.wait.max.ms = 500 ms): the polls below add up to 0.15 s."""
    w = writer(kafka.bootstrap_servers, topic)
    w.append([b"one"])
    with Replayer(kafka.bootstrap_servers, topic, 0, 0) as r:
        list(r.read_to_end(10))
        batch = w.append([b"two", b"three"])
        end = batch.upcoming_offset
        assert end == batch.offsets[-1] + 2  # the commit marker sits between
        tailed = r.poll(10.0)
        for _ in range(3):
            if r.position >= end:
                break
            tailed += r.poll_once(0.05)
        assert payloads(tailed) == [b"two", b"three"]
        assert r.position == end == r.end_offset()
        # A seek back is not undone by the consumer's (older) position.
        r.seek(0)
        assert payloads(list(r.read_to(end, 10))) == [b"one", b"two", b"three"]
        assert r.position == end
    w.close()
