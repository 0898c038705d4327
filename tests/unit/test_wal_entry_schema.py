"""The WAL entry schema moved from kvstore.v1 to kvstore.internal.v1 (not the client API). Its
binary encoding must not change: records already in a WAL (and in snapshots' request-id
windows) must decode exactly as before. Protobuf's wire format carries field numbers, never
package names, so this holds as long as the numbers and types stay; these tests pin both."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from kvstore.internal.v1 import wal_entry_pb2 as pb

# A WalEntry serialized by the schema as it was in kvstore.v1 (proto/kvstore/v1/wal_entry.proto
# before the move): request id, a put, a delete, a response, the leader's time.
OLD_BYTES = b"\n\x03r-1\x12\x08\n\x06\n\x01k\x12\x01v\x12\x08\x12\x06\n\x04gone\x1a\x02\x08\x01 \x80\xd0\x95\xff\xbc1"


def expected() -> pb.WalEntry:
    return pb.WalEntry(request_id="r-1", effects=[pb.Effect(put=pb.PutEffect(key=b"k", value=b"v")),
                                                  pb.Effect(delete=pb.DeleteEffect(key=b"gone"))],
                       response=b"\x08\x01", leader_unix_ms=1_700_000_000_000)


def test_an_entry_written_before_the_move_decodes_the_same() -> None:
    assert pb.WalEntry.FromString(OLD_BYTES) == expected()


def test_the_encoding_is_byte_for_byte_the_old_one() -> None:
    assert expected().SerializeToString(deterministic=True) == OLD_BYTES


def fields(message: type[Message]) -> dict[str, tuple[int, int]]:
    return {f.name: (f.number, f.type) for f in message.DESCRIPTOR.fields}


def test_field_numbers_and_types_are_pinned() -> None:

    t = FieldDescriptor
    assert pb.DESCRIPTOR.package == "kvstore.internal.v1"
    assert fields(pb.WalEntry) == {"request_id": (1, t.TYPE_STRING), "effects": (2, t.TYPE_MESSAGE),
                                   "response": (3, t.TYPE_BYTES), "leader_unix_ms": (4, t.TYPE_INT64),
                                   "request_kind": (5, t.TYPE_ENUM),  # added (issue 18); old entries: 0
                                   # added (issue 21): cross-shard transactions' records
                                   "prepare": (6, t.TYPE_MESSAGE), "decision": (7, t.TYPE_MESSAGE),
                                   "resolve": (8, t.TYPE_MESSAGE),
                                   "forget": (9, t.TYPE_MESSAGE)}  # added: the decision table's end
    assert dict(pb.RequestKind.items()) == {"REQUEST_KIND_UNSPECIFIED": 0, "REQUEST_KIND_PUT": 1,
                                            "REQUEST_KIND_DELETE": 2, "REQUEST_KIND_TXN": 3,
                                            "REQUEST_KIND_WRITE_BATCH_PART": 4, "REQUEST_KIND_TXN_PREPARE": 5,
                                            "REQUEST_KIND_TXN_DECISION": 6, "REQUEST_KIND_TXN_RESOLVE": 7,
                                            "REQUEST_KIND_TXN_ABORTED": 8}
    assert fields(pb.Effect) == {"put": (1, t.TYPE_MESSAGE), "delete": (2, t.TYPE_MESSAGE)}
    assert fields(pb.PutEffect) == {"key": (1, t.TYPE_BYTES), "value": (2, t.TYPE_BYTES)}
    assert fields(pb.DeleteEffect) == {"key": (1, t.TYPE_BYTES)}


def test_transaction_records_are_pinned() -> None:
    """The cross-shard transactions' records (docs/design.md §10) are in the WAL for good too, and
    a snapshot's decided/ and prepared/ tables hold them serialized: numbers and types stay."""
    t = FieldDescriptor
    assert fields(pb.TxnBranch) == {"effects": (1, t.TYPE_MESSAGE), "op_indices": (2, t.TYPE_UINT32),
                                    "results": (3, t.TYPE_BYTES)}
    assert fields(pb.TxnPrepare) == {"txn_id": (1, t.TYPE_STRING), "coordinator": (2, t.TYPE_UINT32),
                                     "participants": (3, t.TYPE_UINT32), "shared_keys": (4, t.TYPE_BYTES),
                                     "exclusive_keys": (5, t.TYPE_BYTES), "compares_held": (6, t.TYPE_BOOL),
                                     "success": (7, t.TYPE_MESSAGE), "failure": (8, t.TYPE_MESSAGE),
                                     "request_id": (9, t.TYPE_STRING),
                                     "first_attempt_unix_ms": (10, t.TYPE_INT64)}  # added with the decision table
    assert fields(pb.TxnDecision) == {"txn_id": (1, t.TYPE_STRING), "commit": (2, t.TYPE_BOOL),
                                      "succeeded": (3, t.TYPE_BOOL), "participants": (4, t.TYPE_UINT32),
                                      "request_id": (5, t.TYPE_STRING), "answer": (6, t.TYPE_BYTES),
                                      "reason": (7, t.TYPE_STRING), "kept": (8, t.TYPE_BOOL)}
    assert fields(pb.TxnResolve) == {"txn_id": (1, t.TYPE_STRING), "commit": (2, t.TYPE_BOOL),
                                     "succeeded": (3, t.TYPE_BOOL), "coordinator": (4, t.TYPE_UINT32)}
    assert fields(pb.TxnVote) == {"compares_held": (1, t.TYPE_BOOL), "success": (2, t.TYPE_MESSAGE),
                                  "failure": (3, t.TYPE_MESSAGE)}
    assert fields(pb.TxnDecided) == {"commit": (1, t.TYPE_BOOL), "succeeded": (2, t.TYPE_BOOL),
                                     "reason": (3, t.TYPE_STRING), "earlier_answer": (4, t.TYPE_BYTES),
                                     "revision": (5, t.TYPE_INT64),
                                     # added with the decision table
                                     "answer": (6, t.TYPE_BYTES), "request_unrecorded": (7, t.TYPE_BOOL)}
    assert fields(pb.TxnForget) == {"txn_ids": (1, t.TYPE_STRING)}
    assert pb.TxnForget.DESCRIPTOR.fields_by_name["txn_ids"].is_repeated


def test_a_forget_record_is_byte_for_byte_pinned() -> None:
    """Field 9, one repeated string: what every replica and the Spark decoder read."""
    forget = pb.WalEntry(forget=pb.TxnForget(txn_ids=["a", "bc"]), leader_unix_ms=1)
    assert forget.SerializeToString(deterministic=True) == b" \x01J\x07\n\x01a\n\x02bc"
