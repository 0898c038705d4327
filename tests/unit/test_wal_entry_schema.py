"""The WAL entry schema moved from kvstore.v1 to kvstore.internal.v1 (not the client API). Its
binary encoding must not change: records already in a WAL (and in snapshots' request-id
windows) must decode exactly as before. Protobuf's wire format carries field numbers, never
package names, so this holds as long as the numbers and types stay; these tests pin both."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

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


def test_field_numbers_and_types_are_pinned() -> None:
    def fields(message: type[pb.WalEntry] | type[pb.Effect] | type[pb.PutEffect] | type[pb.DeleteEffect]
               ) -> dict[str, tuple[int, int]]:
        return {f.name: (f.number, f.type) for f in message.DESCRIPTOR.fields}

    t = FieldDescriptor
    assert pb.DESCRIPTOR.package == "kvstore.internal.v1"
    assert fields(pb.WalEntry) == {"request_id": (1, t.TYPE_STRING), "effects": (2, t.TYPE_MESSAGE),
                                   "response": (3, t.TYPE_BYTES), "leader_unix_ms": (4, t.TYPE_INT64),
                                   "request_kind": (5, t.TYPE_ENUM),  # added (issue 18); old entries: 0
                                   # added (issue 21): cross-shard transactions' records
                                   "prepare": (6, t.TYPE_MESSAGE), "decision": (7, t.TYPE_MESSAGE),
                                   "resolve": (8, t.TYPE_MESSAGE)}
    assert dict(pb.RequestKind.items()) == {"REQUEST_KIND_UNSPECIFIED": 0, "REQUEST_KIND_PUT": 1,
                                            "REQUEST_KIND_DELETE": 2, "REQUEST_KIND_TXN": 3,
                                            "REQUEST_KIND_WRITE_BATCH_PART": 4, "REQUEST_KIND_TXN_PREPARE": 5,
                                            "REQUEST_KIND_TXN_DECISION": 6, "REQUEST_KIND_TXN_RESOLVE": 7}
    assert fields(pb.Effect) == {"put": (1, t.TYPE_MESSAGE), "delete": (2, t.TYPE_MESSAGE)}
    assert fields(pb.PutEffect) == {"key": (1, t.TYPE_BYTES), "value": (2, t.TYPE_BYTES)}
    assert fields(pb.DeleteEffect) == {"key": (1, t.TYPE_BYTES)}
