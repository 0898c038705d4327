"""`wal.errors`: the pure classification of librdkafka errors and the hierarchy's promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from wal.errors import (
    BatchAbortedError,
    ErrorClass,
    FencedError,
    InvalidBatchError,
    OffsetMismatchError,
    UnavailableError,
    UnknownOutcomeError,
    WalError,
    WalTimeoutError,
    WriterFatalError,
    classify,
)

FENCED, FATAL, ABORTABLE, RETRIABLE = (
    ErrorClass.FENCED,
    ErrorClass.FATAL,
    ErrorClass.ABORTABLE,
    ErrorClass.RETRIABLE,
)

# (name, fatal, retriable, txn_requires_abort, expected class)
CLASSIFY_TABLE = [
    # Fencing names win over every flag, including "fatal" (librdkafka flags fencing as fatal).
    pytest.param("_FENCED", True, False, False, FENCED, id="_FENCED-fatal-flag"),
    pytest.param("_FENCED", False, False, False, FENCED, id="_FENCED-no-flags"),
    pytest.param("PRODUCER_FENCED", True, False, False, FENCED, id="PRODUCER_FENCED-fatal-flag"),
    pytest.param("PRODUCER_FENCED", False, True, True, FENCED, id="PRODUCER_FENCED-retriable-abortable"),
    pytest.param("INVALID_PRODUCER_EPOCH", True, False, False, FENCED, id="INVALID_PRODUCER_EPOCH-fatal"),
    pytest.param("INVALID_PRODUCER_EPOCH", False, False, True, FENCED, id="INVALID_PRODUCER_EPOCH-abortable"),
    pytest.param(
        "TRANSACTIONAL_ID_AUTHORIZATION_FAILED", False, False, False, FENCED, id="TXN_ID_AUTHZ_FAILED"
    ),
    # Fatal wins over abortable and retriable.
    pytest.param("_FATAL", True, False, False, FATAL, id="fatal-flag"),
    pytest.param("UNKNOWN_PRODUCER_ID", True, True, True, FATAL, id="fatal-beats-retriable-and-abort"),
    pytest.param("NOT_COORDINATOR", True, False, False, FATAL, id="fatal-beats-retriable-name"),
    # Abortable wins over retriable (flag or name).
    pytest.param("_STATE", False, False, True, ABORTABLE, id="txn_requires_abort"),
    pytest.param("_TIMED_OUT", False, True, True, ABORTABLE, id="abort-beats-retriable-flag"),
    pytest.param("CONCURRENT_TRANSACTIONS", False, False, True, ABORTABLE, id="abort-beats-retriable-name"),
    # Retriable by flag.
    pytest.param("SOME_NEW_ERROR", False, True, False, RETRIABLE, id="retriable-flag-unknown-name"),
    pytest.param("_MSG_TIMED_OUT", False, True, False, RETRIABLE, id="retriable-flag-msg-timed-out"),
    # Retriable by name even without the flag.
    pytest.param("NOT_COORDINATOR", False, False, False, RETRIABLE, id="name-NOT_COORDINATOR"),
    pytest.param("COORDINATOR_NOT_AVAILABLE", False, False, False, RETRIABLE, id="name-COORDINATOR_NOT_AVAIL"),
    pytest.param("COORDINATOR_LOAD_IN_PROGRESS", False, False, False, RETRIABLE, id="name-COORDINATOR_LOADING"),
    pytest.param("CONCURRENT_TRANSACTIONS", False, False, False, RETRIABLE, id="name-CONCURRENT_TRANSACTIONS"),
    pytest.param("REQUEST_TIMED_OUT", False, False, False, RETRIABLE, id="name-REQUEST_TIMED_OUT"),
    pytest.param("_TIMED_OUT", False, False, False, RETRIABLE, id="name-_TIMED_OUT"),
    pytest.param("_TRANSPORT", False, False, False, RETRIABLE, id="name-_TRANSPORT"),
    pytest.param("_ALL_BROKERS_DOWN", False, False, False, RETRIABLE, id="name-_ALL_BROKERS_DOWN"),
    pytest.param("NOT_LEADER_OR_FOLLOWER", False, False, False, RETRIABLE, id="name-NOT_LEADER_OR_FOLLOWER"),
    pytest.param("NOT_ENOUGH_REPLICAS", False, False, False, RETRIABLE, id="name-NOT_ENOUGH_REPLICAS"),
    # Retriable by name *and* flag is still retriable.
    pytest.param("NOT_COORDINATOR", False, True, False, RETRIABLE, id="name-and-flag-retriable"),
    # Unknown, unflagged errors are abortable (aborting an uncommitted batch is always safe).
    pytest.param("SOME_NEW_ERROR", False, False, False, ABORTABLE, id="unknown-unflagged"),
    pytest.param("_FAIL", False, False, False, ABORTABLE, id="generic-_FAIL-unflagged"),
    pytest.param("", False, False, False, ABORTABLE, id="empty-name-unflagged"),
    # Names are matched exactly (librdkafka's KafkaError.name() is upper case).
    pytest.param("not_coordinator", False, False, False, ABORTABLE, id="name-match-is-case-sensitive"),
    pytest.param("producer_fenced", True, False, False, FATAL, id="fenced-name-case-sensitive"),
]


@pytest.mark.parametrize(("name", "fatal", "retriable", "txn_requires_abort", "expected"), CLASSIFY_TABLE)
def test_classify(name: str, fatal: bool, retriable: bool, txn_requires_abort: bool, expected: ErrorClass) -> None:
    assert classify(name, fatal=fatal, retriable=retriable, txn_requires_abort=txn_requires_abort) is expected


@pytest.mark.parametrize(
    ("cls", "base", "is_subclass"),
    [
        pytest.param(OffsetMismatchError, BatchAbortedError, True, id="OffsetMismatch-is-BatchAborted"),
        pytest.param(FencedError, WriterFatalError, True, id="Fenced-is-WriterFatal"),
        pytest.param(WalTimeoutError, UnavailableError, True, id="WalTimeout-is-Unavailable"),
        pytest.param(InvalidBatchError, WalError, True, id="InvalidBatch-is-WalError"),
        pytest.param(UnavailableError, WalError, True, id="Unavailable-is-WalError"),
        pytest.param(WriterFatalError, WalError, True, id="WriterFatal-is-WalError"),
        pytest.param(BatchAbortedError, WalError, True, id="BatchAborted-is-WalError"),
        pytest.param(UnknownOutcomeError, WalError, True, id="UnknownOutcome-is-WalError"),
        pytest.param(WalError, Exception, True, id="WalError-is-Exception"),
        # The classes a caller must tell apart are not confused by the hierarchy.
        pytest.param(UnknownOutcomeError, BatchAbortedError, False, id="UnknownOutcome-not-BatchAborted"),
        pytest.param(BatchAbortedError, UnknownOutcomeError, False, id="BatchAborted-not-UnknownOutcome"),
        pytest.param(FencedError, BatchAbortedError, False, id="Fenced-not-BatchAborted"),
        pytest.param(OffsetMismatchError, WriterFatalError, False, id="OffsetMismatch-not-WriterFatal"),
        pytest.param(UnavailableError, BatchAbortedError, False, id="Unavailable-not-BatchAborted"),
        pytest.param(WriterFatalError, FencedError, False, id="WriterFatal-not-Fenced"),
    ],
)
def test_hierarchy(cls: type[Exception], base: type[Exception], is_subclass: bool) -> None:
    assert issubclass(cls, base) is is_subclass


@pytest.mark.parametrize(
    ("error", "retriable"),
    [
        pytest.param(WalError("x"), False, id="WalError"),
        pytest.param(InvalidBatchError("x"), False, id="InvalidBatch"),
        pytest.param(UnavailableError("x"), True, id="Unavailable"),
        pytest.param(WalTimeoutError("x"), True, id="WalTimeout"),
        pytest.param(WriterFatalError("x"), False, id="WriterFatal"),
        pytest.param(FencedError("x"), False, id="Fenced"),
        pytest.param(BatchAbortedError("x"), True, id="BatchAborted"),
        pytest.param(OffsetMismatchError("x", expected=1, actual=2), True, id="OffsetMismatch"),
        pytest.param(UnknownOutcomeError("x"), True, id="UnknownOutcome"),
        pytest.param(UnknownOutcomeError("x", fenced=True), True, id="UnknownOutcome-fenced"),
    ],
)
def test_retriable_flag(error: WalError, retriable: bool) -> None:
    assert error.retriable is retriable


def test_offset_mismatch_carries_offsets_and_message() -> None:
    error = OffsetMismatchError("record 1 landed at 12, expected 11", expected=11, actual=12)
    assert (error.expected, error.actual) == (11, 12)
    assert str(error) == "record 1 landed at 12, expected 11"


@pytest.mark.parametrize(
    ("kwargs", "fenced"),
    [pytest.param({}, False, id="default-not-fenced"), pytest.param({"fenced": True}, True, id="fenced")],
)
def test_unknown_outcome_fenced_attribute(kwargs: dict[str, bool], fenced: bool) -> None:
    error = UnknownOutcomeError("commit timed out", **kwargs)
    assert error.fenced is fenced
    assert str(error) == "commit timed out"


def test_every_error_class_has_a_distinct_value() -> None:
    assert len({c.value for c in ErrorClass}) == len(ErrorClass) == 4


def test_transactional_id_follows_the_topic() -> None:
    from wal import shard_transactional_id

    assert shard_transactional_id("prod.wal", 3) == "prod.wal.shard-3"
    # One cluster's two topics must not share an id (they would fence each other's leaders).
    assert shard_transactional_id("t1", 0) != shard_transactional_id("t2", 0)


def test_two_deployments_sharing_a_topic_share_transactional_ids(tmp_path: Path) -> None:
    """Different cluster names, one topic: the same partitions, so the same writers' ids, so a
    leader of one deployment fences the other's (tests/integration/test_fencing.py runs it)."""
    from kvstore.server.config import ReplicaConfig
    from kvstore.server.replica import writer_config

    def tid(cluster: str, topic: str) -> str:
        config = ReplicaConfig(cluster=cluster, topic=topic, shard=2, bootstrap_servers="127.0.0.1:1",
                               node_id="n", data_dir=tmp_path / cluster / topic)
        return writer_config(config).transactional_id

    assert tid("blue", "shared.wal") == tid("green", "shared.wal")
    assert tid("blue", "blue.wal") != tid("blue", "other.wal")


@pytest.mark.parametrize(
    ("message", "before"),
    [
        ("Operation not valid in state AbortableError", True),
        ("Failed to flush all outstanding messages within the API timeout: 3 message(s) remaining", True),
        ("2 message(s) failed delivery (see individual delivery reports)", True),
        ("No PID available (idempotence state WaitPID)", True),
        ("Failed to send EndTxn request: Local: Broker transport failure", True),
        # After EndTxn was sent, or wording we do not know: never taken as definite.
        ("EndTxn commit failed: Broker: Request timed out", False),
        ("Transactional API operation (commit_transaction) timed out", False),
        ("Broker: Producer attempted to produce with an old epoch", False),
        ("", False),
    ],
)
def test_commit_errors_raised_before_end_txn(message: str, before: bool) -> None:
    from wal.errors import raised_before_end_txn

    assert raised_before_end_txn(message) is before


def test_store_errors_are_tagged_definite_or_unknown_in_one_place() -> None:
    import grpc

    from kvstore import errors as store_errors

    definite = [store_errors.InvalidRequestError("x"), store_errors.NotLeaderError(1, "h:1"),
                store_errors.OverloadedError("x"), store_errors.UnavailableError("x"),
                store_errors.RequestExpiredError("x")]
    for error in definite:
        _code, _details, metadata = store_errors.to_status(error)
        assert (store_errors.OUTCOME_KEY, store_errors.OUTCOME_NONE) in metadata, error
    code, _details, metadata = store_errors.to_status(store_errors.UnknownOutcomeError("x"))
    assert code is grpc.StatusCode.UNKNOWN
    assert dict(metadata)[store_errors.OUTCOME_KEY] == store_errors.OUTCOME_UNKNOWN
    code, _details, metadata = store_errors.to_status(store_errors.RequestExpiredError("x"))
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert dict(metadata)[store_errors.REASON_KEY] == store_errors.REASON_REQUEST_ID_EXPIRED
