"""The placement log's one apply (kvstore.core.placement_log): what every reader derives, and that
no byte of the log can stop a reader (issue 33: one hostile control record stopped placement on
every node, for good)."""

from __future__ import annotations

import random

import pytest

from kvstore.core.placement_log import (
    MAX_RECORD_BYTES,
    CopyState,
    PlacementState,
    Settings,
    fold,
)
from kvstore.internal.v1 import placement_pb2

Step = placement_pb2.CopyStepKind
SETTINGS = Settings(shard_count=4, replication_factor=2, grace_ms=1000, max_learners_per_node=2)


def rec(**kind: object) -> bytes:
    return placement_pb2.PlacementRecord(reason="test", **kind).SerializeToString()  # type: ignore[arg-type]


def step(shard: int, node: str, kind: int) -> bytes:
    return rec(step=placement_pb2.CopyStep(shard=shard, node_id=node, kind=kind))  # type: ignore[arg-type]


def started(*nodes: str) -> PlacementState:
    state = PlacementState()
    assert state.apply(0, rec(settings=SETTINGS.to_proto())) is None
    for node in nodes:
        assert state.apply(state.position, rec(node_joined=placement_pb2.NodeJoined(node_id=node))) is None
    return state


def test_a_copy_moves_through_its_steps_and_the_epoch_counts_only_target_changes() -> None:
    state = started("a", "b", "c")
    epoch = state.epoch
    assert state.targets() and all(len(t) == 2 for t in state.targets())
    for kind, expected in ((Step.COPY_STEP_KIND_ADD_LEARNER, CopyState.LEARNER),
                           (Step.COPY_STEP_KIND_PROMOTE, CopyState.REPLICA),
                           (Step.COPY_STEP_KIND_RETIRE, CopyState.RETIRING),
                           (Step.COPY_STEP_KIND_REJOIN, CopyState.REPLICA),
                           (Step.COPY_STEP_KIND_RETIRE, CopyState.RETIRING)):
        assert state.apply(state.position, step(1, "a", kind)) is None
        assert state.copy_state(1, "a") is expected
    assert state.epoch == epoch  # steps move copies, not targets
    assert state.apply(state.position, step(1, "a", Step.COPY_STEP_KIND_DROP)) is None
    assert state.copy_state(1, "a") is None and (1, "a") in state.dropped
    assert state.apply(state.position, rec(drain=placement_pb2.DrainNode(node_id="a"))) is None
    assert state.epoch == epoch + 1 and "a" not in {n for t in state.targets() for n in t}


@pytest.mark.parametrize(("payload", "why"), [
    (b"\xff\xff\xff", "undecodable"),
    (b"[" * 2400, "undecodable"),  # the nesting that raised RecursionError out of the old reader
    (b"\x0a" + b"\x80" * 20, "undecodable"),
    (b"", "no known kind"),
    (rec(step=placement_pb2.CopyStep(shard=99, node_id="a", kind=Step.COPY_STEP_KIND_ADD_LEARNER)),
     "invalid step: shard 99 does not exist"),
    (rec(step=placement_pb2.CopyStep(shard=0, node_id="zz", kind=Step.COPY_STEP_KIND_ADD_LEARNER)), "not a member"),
    (rec(step=placement_pb2.CopyStep(shard=0, node_id="a", kind=Step.COPY_STEP_KIND_PROMOTE)), "invalid step: promote"),
    (rec(step=placement_pb2.CopyStep(shard=0, node_id="a", kind=77)), "invalid step: unknown kind"),  # type: ignore[arg-type]
    (rec(node_joined=placement_pb2.NodeJoined(node_id="")), "an empty node id"),
    (rec(node_joined=placement_pb2.NodeJoined(node_id="x" * 300)), "a node id over"),
    (rec(node_joined=placement_pb2.NodeJoined(node_id="a\x00b")), "unprintable"),
    (rec(node_gone=placement_pb2.NodeGone(node_id="nobody")), "not a member"),
    (rec(pin=placement_pb2.PinShard(shard=4, nodes=["a"])), "invalid pin: shard 4"),
    (rec(pin=placement_pb2.PinShard(shard=0, nodes=["a", "a"])), "to one twice"),
    (rec(settings=placement_pb2.PlacementSettings(shard_count=8, replication_factor=2, grace_ms=1,
                                                  max_learners_per_node=1)),
     "invalid settings: the shard count is fixed"),
    (rec(settings=placement_pb2.PlacementSettings(shard_count=4)), "invalid settings: replication factor"),
    (b"\x00" * (MAX_RECORD_BYTES + 1), "too large"),
    (rec(controller_started=placement_pb2.ControllerStarted(node_id="a", term=2**64 - 1)), "invalid controller"),
])
def test_a_record_no_reader_takes_is_skipped_counted_and_changes_nothing(payload: bytes, why: str) -> None:
    state = started("a", "b")
    before = (state.epoch, dict(state.nodes), state.targets(), {s: dict(c) for s, c in state.copies.items()})
    reason = state.apply(state.position, payload)
    assert reason is not None and why in reason, reason
    assert (state.epoch, dict(state.nodes), state.targets(), {s: dict(c) for s, c in state.copies.items()}) == before
    assert sum(state.skipped.values()) == 1
    # ... and the next record is taken as if the bad one had not been there.
    assert state.apply(state.position, step(0, "a", Step.COPY_STEP_KIND_ADD_LEARNER)) is None


def test_nothing_before_the_settings_is_taken() -> None:
    state = PlacementState()
    assert "before the settings" in (state.apply(0, rec(node_joined=placement_pb2.NodeJoined(node_id="a"))) or "")
    assert state.targets() == ()


def test_any_bytes_never_raise_and_every_reader_folds_them_alike() -> None:
    """A fuzz of the decoder: random bytes, and valid records with bytes flipped, in any order;
    two readers of the same log end equal (the apply reads nothing but the log)."""
    rng = random.Random(33)
    valid = [rec(settings=SETTINGS.to_proto()), *(rec(node_joined=placement_pb2.NodeJoined(node_id=n, zone=z))
                                                   for n, z in (("a", "z1"), ("b", "z2"), ("c", "z1")))]
    valid += [step(s, n, k) for s in range(5) for n in "abcd" for k in range(6)]
    valid += [rec(drain=placement_pb2.DrainNode(node_id="b")), rec(pin=placement_pb2.PinShard(shard=1, nodes=["c"]))]
    for _ in range(200):
        log: list[tuple[int, bytes]] = []
        for offset in range(rng.randrange(1, 60)):
            choice = rng.random()
            if choice < 0.5:
                payload = rng.choice(valid)
            elif choice < 0.8:
                raw = bytearray(rng.choice(valid))
                for _ in range(rng.randrange(1, 4)):
                    if raw:
                        raw[rng.randrange(len(raw))] = rng.randrange(256)
                payload = bytes(raw)
            else:
                payload = rng.randbytes(rng.randrange(0, 64))
            log.append((offset * 2, payload))
        one, two = fold(log), fold(log)
        assert (one.epoch, one.nodes, one.copies, one.dropped, one.skipped) == \
            (two.epoch, two.nodes, two.copies, two.dropped, two.skipped)
        assert one.applied + sum(one.skipped.values()) == len(log)
        one.targets()  # computable whatever was taken


def test_zones_spread_each_shards_replicas() -> None:
    state = PlacementState()
    state.apply(0, rec(settings=Settings(8, 2, 1000, 2).to_proto()))
    for offset, (node, zone) in enumerate((("a", "east"), ("b", "east"), ("c", "west"), ("d", "west")), start=1):
        state.apply(offset, rec(node_joined=placement_pb2.NodeJoined(node_id=node, zone=zone)))
    for target in state.targets():
        assert len(target) == 2 and {state.nodes[n] for n in target} == {"east", "west"}, target


def test_a_controller_term_only_grows_and_hostile_names_cannot_grow_the_counters() -> None:
    state = started("a")
    assert state.apply(state.position, rec(controller_started=placement_pb2.ControllerStarted(
        node_id="a", address="a:1", term=3))) is None
    for term in (3, 2):
        started_again = placement_pb2.ControllerStarted(node_id="b", term=term)
        why = state.apply(state.position, rec(controller_started=started_again))
        assert why is not None and why.startswith("invalid controller")
    assert state.controller is not None and state.controller.term == 3
    for i in range(500):  # every record a new name: the counters stay a fixed set of categories
        state.apply(state.position, rec(node_gone=placement_pb2.NodeGone(node_id=f"nobody-{i}" * 10)))
        state.apply(state.position, step(i % 4, f"x{i}", Step.COPY_STEP_KIND_PROMOTE))
    assert set(state.skipped) == {"invalid controller", "not a member", "invalid step"}
    assert all(len(e.summary) < 400 for e in state.recent)


def test_settings_and_names_beyond_the_bounds_are_refused_and_an_unpin_is_taken() -> None:
    from kvstore.core.placement_log import MAX_NODES, zone_problem
    for bad in (Settings(0, 2, 1000, 2), Settings(4, 2, -1, 2), Settings(4, 2, 1000, 0)):
        assert bad.problem() is not None
        assert "invalid settings" in (PlacementState().apply(0, rec(settings=bad.to_proto())) or "")
    assert zone_problem("z" * 65) is not None and zone_problem("") is None
    state = started("a")
    why = state.apply(state.position, rec(node_joined=placement_pb2.NodeJoined(node_id="b", zone="z" * 65)))
    assert why is not None and why.startswith("invalid zone")
    assert state.apply(state.position, rec(pin=placement_pb2.PinShard(shard=1, nodes=["a"]))) is None
    assert state.apply(state.position, rec(pin=placement_pb2.PinShard(shard=1))) is None and 1 not in state.pins
    many = started()
    for i in range(MAX_NODES):
        many.nodes[f"n{i}"] = ""
        many.drained.add(f"n{i}")
    assert "too many nodes" in (many.apply(many.position, rec(node_joined=placement_pb2.NodeJoined(node_id="x"))) or "")
    assert "too many nodes" in (many.apply(many.position, rec(drain=placement_pb2.DrainNode(node_id="x"))) or "")
