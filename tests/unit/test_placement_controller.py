"""The placement controller's decisions (kvstore.core.placement_controller) and the nodes' following
(kvstore.core.placement_follower), driven together without Kafka: the scenarios of issue 33's
review, each with P2 checked after every append (the simulation runs them under faults)."""

from __future__ import annotations

import pytest

from kvstore.core import placement_follower
from kvstore.core.placement_controller import (
    CopyReport,
    Drain,
    Move,
    NodeReport,
    PlacementController,
    RequestRefused,
    shard_ranges,
)
from kvstore.core.placement_follower import Act, Local
from kvstore.core.placement_log import CopyState, PlacementState, Settings
from kvstore.internal.v1 import placement_pb2

ROUND_MS = 500


class Cluster:
    """Nodes with their copies (`disk`), one controller, one log; every node up reports each round."""

    def __init__(self, nodes: list[str], *, shards: int = 10, r: int = 2, grace_ms: int = 4000,
                 learners: int = 2) -> None:
        self.settings = Settings(shards, r, grace_ms, learners)
        self.state = PlacementState()
        self.now = 0
        self.up = set(nodes)
        self.listing_fails = False
        self.disk: dict[str, dict[int, Local]] = {node: {} for node in nodes}
        self.controller = PlacementController("c", "c:1", 1, self.settings, self.now)
        self.deleted: list[tuple[str, int]] = []

    def start(self, node: str) -> None:
        """A node (re)starts: its copies on disk are reopened, not caught up yet."""
        self.up.add(node)
        self.disk[node] = {shard: Local(True, False, False, found_at_start=True) for shard in self.disk.get(node, {})}

    def round(self) -> list[placement_pb2.PlacementRecord]:
        self.now += ROUND_MS
        if not self.listing_fails:
            self.controller.members_listed(sorted(self.up), self.now)
        for node in sorted(self.up):
            copies = {s: CopyReport(local.in_group, local.caught_up) for s, local in self.disk[node].items()}
            self.controller.report(NodeReport(node, "", copies, self.now))
        records = self.controller.plan(self.state, self.now)
        self.append(records)
        self.follow()
        return records

    def append(self, records: list[placement_pb2.PlacementRecord]) -> None:
        for record in records:
            before = self.ready_copies()
            assert self.state.apply(self.state.position, record.SerializeToString()) is None
            if record.WhichOneof("kind") == "step" and record.step.kind in (
                    placement_pb2.COPY_STEP_KIND_RETIRE, placement_pb2.COPY_STEP_KIND_DROP):
                shard = record.step.shard
                needed = min(self.settings.replication_factor, len(self.state.candidates))
                left = before[shard] - {record.step.node_id}
                assert len(left) >= needed, f"P2: {record} leaves {sorted(left)} ready (needed {needed})"

    def ready_copies(self) -> dict[int, set[str]]:
        """Really caught up and in the group (the nodes' own state, not their reports)."""
        ready: dict[int, set[str]] = {s: set() for s in range(self.settings.shard_count)}
        for node in self.up:
            for shard, local in self.disk[node].items():
                if local.caught_up and local.in_group:
                    ready[shard].add(node)
        return ready

    def follow(self) -> None:
        for node in sorted(self.up):
            for shard, act in placement_follower.acts(self.state, node, self.disk[node]):
                local = self.disk[node].get(shard)
                if act is Act.OPEN:
                    self.disk[node][shard] = Local(True, False, False)
                elif act is Act.JOIN:
                    assert local is not None
                    self.disk[node][shard] = Local(True, True, True)
                elif act is Act.LEAVE:
                    assert local is not None
                    self.disk[node][shard] = Local(True, False, local.caught_up)
                else:
                    assert self.state.copy_state(shard, node) is None and (shard, node) in self.state.dropped
                    del self.disk[node][shard]
                    self.deleted.append((node, shard))
            for shard, local in list(self.disk[node].items()):  # a copy catches up within a round
                if not local.caught_up:
                    self.disk[node][shard] = Local(True, local.in_group, True)

    def settle(self, rounds: int = 60) -> None:
        quiet = 0
        for _ in range(rounds):
            quiet = 0 if self.round() else quiet + 1
            if quiet >= 3:
                return
        raise AssertionError("placement did not settle")

    def assert_settled(self) -> None:
        for shard, target in enumerate(self.state.targets()):
            assert dict(self.state.copies_of(shard)) == dict.fromkeys(target, CopyState.REPLICA), shard
            for node in target:
                assert self.disk[node][shard].in_group


def test_a_new_cluster_waits_for_its_members_then_opens_only_the_copies_placed() -> None:
    cluster = Cluster(["a", "b", "c", "d", "e"])
    first = cluster.round()
    assert first == []  # the listing must stay the same for STARTUP_QUIET_MS first
    cluster.settle()
    cluster.assert_settled()
    assert sum(len(copies) for copies in cluster.disk.values()) == 10 * 2  # never a copy more than placed
    assert cluster.deleted == []
    assert [e.kind for e in list(cluster.state.recent)[:7]] == ["settings", "controller_started", *["node_joined"] * 5]


def test_a_node_late_at_cold_start_takes_its_share_and_no_copy_goes_before_its_replacement() -> None:
    cluster = Cluster(["a", "b", "c", "d", "e"])
    cluster.up.discard("c")
    cluster.settle()
    cluster.assert_settled()
    cluster.start("c")
    cluster.settle()
    cluster.assert_settled()
    assert any(node == "c" for copies in cluster.state.copies.values() for node in copies)


def test_a_restarted_node_keeps_its_copies_and_moves_nothing_within_the_grace_period() -> None:
    cluster = Cluster(["a", "b", "c"])
    cluster.settle()
    held = {s for s, copies in cluster.state.copies.items() if "b" in copies}
    epoch = cluster.state.epoch
    cluster.up.discard("b")
    for _ in range(4):  # 2 s away, grace 4 s
        cluster.round()
    cluster.start("b")  # reopened from disk: REPLICA in the log, not caught up yet
    cluster.settle()
    assert cluster.state.epoch == epoch and {s for s, c in cluster.state.copies.items() if "b" in c} == held
    assert cluster.deleted == []


def test_a_node_away_past_the_grace_period_is_gone_and_its_shards_re_replicated() -> None:
    cluster = Cluster(["a", "b", "c"])
    cluster.settle()
    cluster.up.discard("b")
    for _ in range(10):  # 5 s, grace 4 s
        cluster.round()
    cluster.settle()
    assert "b" not in cluster.state.nodes
    cluster.assert_settled()


def test_a_controller_that_cannot_list_the_members_declares_nobody_dead() -> None:
    cluster = Cluster(["a", "b", "c"])
    cluster.settle()
    cluster.listing_fails = True
    cluster.up.discard("b")
    for _ in range(30):  # 15 s, grace 4 s: a stale view must not count as "not listed"
        cluster.round()
    assert "b" in cluster.state.nodes


def test_learners_per_node_are_bounded() -> None:
    cluster = Cluster(["a"], shards=8, r=1, learners=2)
    for _ in range(5):
        cluster.round()
        learners = sum(1 for copies in cluster.state.copies.values() if copies.get("a") is CopyState.LEARNER)
        assert learners <= 2


def test_a_drain_below_r_is_refused_naming_the_shards_unless_forced() -> None:
    cluster = Cluster(["a", "b", "c"], shards=4, r=3)
    cluster.settle()
    with pytest.raises(RequestRefused, match=r"leaves 2 node\(s\) able to hold copies .* shards 0-3 would keep"):
        cluster.controller.request(cluster.state, Drain("a", cluster.state.epoch), cluster.now)
    cluster.append(cluster.controller.request(cluster.state, Drain("a", cluster.state.epoch, force=True), cluster.now))
    assert "a" in cluster.state.forced_drains
    cluster.settle()
    assert not any("a" in copies for copies in cluster.state.copies.values())


def test_a_drain_while_another_node_is_away_counts_the_away_node_as_gone() -> None:
    cluster = Cluster(["a", "b", "c", "d"], shards=4, r=3)
    cluster.settle()
    cluster.up.discard("d")  # SIGKILLed: still listed until its session times out, but silent
    cluster.controller.members_listed(["a", "b", "c", "d"], cluster.now)
    for _ in range(7):  # silent for more than REPORT_MAX_AGE_MS
        cluster.round()
        cluster.controller.members_listed(["a", "b", "c", "d"], cluster.now)
    with pytest.raises(RequestRefused, match="drained or away nodes do not count"):
        cluster.controller.request(cluster.state, Drain("a", cluster.state.epoch), cluster.now)


def test_a_request_computed_from_an_older_epoch_is_refused_not_merged() -> None:
    cluster = Cluster(["a", "b", "c"])
    cluster.settle()
    old = cluster.state.epoch
    cluster.append(cluster.controller.request(cluster.state, Drain("a", old), cluster.now))
    for request in (Drain("b", old), Move(1, old, to="a")):
        with pytest.raises(RequestRefused, match="placement changed") as refused:
            cluster.controller.request(cluster.state, request, cluster.now)
        assert refused.value.stale


def test_a_move_pins_the_shard_and_completes() -> None:
    cluster = Cluster(["a", "b", "c"])
    cluster.settle()
    target = cluster.state.targets()[3]
    to = next(n for n in "abc" if n not in target)
    cluster.append(cluster.controller.request(cluster.state, Move(3, cluster.state.epoch, to=to), cluster.now))
    cluster.settle()
    cluster.assert_settled()
    assert to in cluster.state.targets()[3]
    with pytest.raises(RequestRefused, match="already holds"):
        cluster.controller.request(cluster.state, Move(3, cluster.state.epoch, to=to), cluster.now)


def test_a_copy_the_log_does_not_mention_is_kept_until_the_log_drops_it() -> None:
    cluster = Cluster(["a", "b", "c"])
    cluster.settle()
    spare = next(s for s, copies in cluster.state.copies.items() if "a" not in copies)
    cluster.disk["a"][spare] = Local(True, False, True, found_at_start=True)  # left by an unfinished drop
    assert placement_follower.acts(cluster.state, "a", cluster.disk["a"]) == []
    cluster.settle()
    assert (spare, "a") in cluster.state.dropped and spare not in cluster.disk["a"]


def test_a_request_right_after_taking_office_is_recorded_after_the_controllers_start() -> None:
    """P1: every record after ControllerStarted(node, t) is that controller's. A controller new in
    office (fenced, the log read) asked before its first plan records its ControllerStarted first,
    or the request's record would be read as the previous controller's decision (the simulation
    found it: a drain landed after ControllerStarted of term 1, written by term 19)."""
    cluster = Cluster(["a", "b", "c"])
    cluster.settle()
    new = PlacementController("d", "d:1", 2, cluster.settings, cluster.now)
    new.members_listed(sorted(cluster.up), cluster.now)
    for node in sorted(cluster.up):
        copies = {s: CopyReport(local.in_group, local.caught_up) for s, local in cluster.disk[node].items()}
        new.report(NodeReport(node, "", copies, cluster.now))
    records = new.request(cluster.state, Drain("a", cluster.state.epoch), cluster.now)
    assert [r.WhichOneof("kind") for r in records] == ["controller_started", "drain"]
    assert (records[0].controller_started.node_id, records[0].controller_started.term) == ("d", 2)
    cluster.append(records)
    assert cluster.state.controller is not None and cluster.state.controller.node_id == "d"
    records = new.request(cluster.state, Drain("a", cluster.state.epoch, undo=True), cluster.now)
    assert [r.WhichOneof("kind") for r in records] == ["drain"]  # the log names it now


def test_shard_ranges_reads_well() -> None:
    assert shard_ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3, 7, 9-10" and shard_ranges([]) == ""


def test_a_retired_copy_serves_again_when_the_shard_falls_below_the_floor() -> None:
    """Review finding: a move retired the giver, then a kept replica dropped out of the group (a
    rebuild) and the new one died: the caught-up retired copy rejoins instead of idling."""
    cluster = Cluster(["a", "b", "c"], shards=3, r=2)
    cluster.settle()
    shard = 0
    target = cluster.state.targets()[shard]
    to = next(n for n in "abc" if n not in target)
    cluster.append(cluster.controller.request(cluster.state, Move(shard, cluster.state.epoch, to=to), cluster.now))
    for _ in range(40):
        cluster.round()
        if CopyState.RETIRING in cluster.state.copies_of(shard).values():
            break
    retiring = next(n for n, c in cluster.state.copies_of(shard).items() if c is CopyState.RETIRING)
    kept = [n for n, c in cluster.state.copies_of(shard).items() if c is CopyState.REPLICA]
    for node in kept:  # both replicas drop out of the group (rebuilding)
        cluster.disk[node][shard] = Local(True, False, False)
    cluster.now += ROUND_MS
    cluster.controller.members_listed(sorted(cluster.up), cluster.now)
    for node in sorted(cluster.up):
        copies = {s: CopyReport(local.in_group, local.caught_up and not (node in kept and s == shard))
                  for s, local in cluster.disk[node].items()}
        cluster.controller.report(NodeReport(node, "", copies, cluster.now))
    records = cluster.controller.plan(cluster.state, cluster.now)
    assert any(r.step.kind == placement_pb2.COPY_STEP_KIND_REJOIN and r.step.node_id == retiring for r in records)


def test_draining_every_candidate_keeps_the_floor() -> None:
    """Review finding: with every node drained (forced) the floor fell to zero while the rule
    still placed the shards on the drained nodes."""
    cluster = Cluster(["a", "b", "c"], shards=4, r=2)
    cluster.settle()
    for node in "abc":
        cluster.append(cluster.controller.request(cluster.state, Drain(node, cluster.state.epoch, force=True),
                                                  cluster.now))
        cluster.settle()  # the P2 check of every append holds throughout
    cluster.assert_settled()


def test_a_zone_the_log_would_refuse_is_never_written() -> None:
    """Review finding: a zone `--zone` accepted but the fold skips was appended again every round,
    and the early return for member records starved every shard step."""
    cluster = Cluster(["a", "b"], shards=2, r=2)
    cluster.settle()
    cluster.now += ROUND_MS
    cluster.controller.members_listed(["a", "b", "c"], cluster.now)
    cluster.controller.report(NodeReport("c", "rack\t1", {}, cluster.now))
    for node in "ab":
        copies = {s: CopyReport(local.in_group, local.caught_up) for s, local in cluster.disk[node].items()}
        cluster.controller.report(NodeReport(node, "", copies, cluster.now))
    assert all(r.WhichOneof("kind") != "node_joined" for r in cluster.controller.plan(cluster.state, cluster.now))


def test_a_controller_taking_office_again_keeps_what_it_observed() -> None:
    """Review finding: every re-take of the office restarted the grace periods."""
    cluster = Cluster(["a", "b", "c"])
    cluster.settle()
    cluster.up.discard("b")
    for _ in range(10):  # 5 s away, grace 4 s, the office taken again each round
        cluster.controller = PlacementController("c", "c:1", cluster.controller.term + 1, cluster.settings,
                                                 cluster.now, previous=cluster.controller)
        cluster.round()
    cluster.settle()
    assert "b" not in cluster.state.nodes


def test_a_drain_judged_on_old_reports_is_retried_not_refused() -> None:
    """Second review: a controller whose rounds were held up (every report a moment old) refused a
    healthy drain as below R; it asks for a retry instead."""
    cluster = Cluster(["a", "b", "c", "d"], shards=4, r=3)
    cluster.settle()
    with pytest.raises(RequestRefused) as refused:
        cluster.controller.request(cluster.state, Drain("a", cluster.state.epoch), cluster.now + 3500)
    assert refused.value.retry and not refused.value.below_r
    cluster.append(cluster.controller.request(cluster.state, Drain("a", cluster.state.epoch), cluster.now))


def test_undoing_one_drain_of_an_all_drained_cluster_is_refused_unless_forced() -> None:
    """Second review: with every member drained the rule uses them all; undoing one drain would
    have put every shard on that one node and dropped the other copies."""
    cluster = Cluster(["a", "b", "c"], shards=4, r=2)
    cluster.settle()
    for node in "abc":
        cluster.append(cluster.controller.request(cluster.state, Drain(node, cluster.state.epoch, force=True),
                                                  cluster.now))
    cluster.settle()
    with pytest.raises(RequestRefused, match="every member is drained"):
        cluster.controller.request(cluster.state, Drain("a", cluster.state.epoch, undo=True), cluster.now)
    for node in "ab":
        cluster.append(cluster.controller.request(cluster.state, Drain(node, cluster.state.epoch, undo=True,
                                                                       force=node == "a"), cluster.now))
        cluster.settle()
    cluster.assert_settled()


def test_caught_up_is_reached_within_the_lag_bound_and_able() -> None:
    from kvstore.core.placement_controller import CAUGHT_UP_LAG, is_caught_up
    assert is_caught_up(True, CAUGHT_UP_LAG, False)
    assert not is_caught_up(True, CAUGHT_UP_LAG + 1, False)
    assert not is_caught_up(False, 0, False) and not is_caught_up(True, 0, True) and not is_caught_up(True, -1, False)


def test_operators_mistakes_are_refused_saying_why_and_repeats_are_no_ops() -> None:
    empty = PlacementState()
    machine = PlacementController("c", "c:1", 1, Settings(4, 2, 4000, 2), 0)
    assert machine.away_ms(empty) == {}  # no listing yet: nobody is away
    with pytest.raises(RequestRefused, match="no placement yet"):
        machine.request(empty, Drain("a", 0), 0)
    cluster = Cluster(["a", "b", "c"], shards=4, r=2)
    cluster.settle()
    state, request = cluster.state, cluster.controller.request

    def ask(what: Drain | Move) -> list[placement_pb2.PlacementRecord]:
        return request(state, what, cluster.now)

    assert ask(Drain("a", state.epoch, undo=True)) == []  # not drained: nothing to undo
    with pytest.raises(RequestRefused, match="not a member"):
        ask(Drain("zz", state.epoch))
    with pytest.raises(RequestRefused, match="does not exist"):
        ask(Move(9, state.epoch, to="a"))
    assert ask(Move(1, state.epoch, unpin=True)) == []  # not pinned
    with pytest.raises(RequestRefused, match="not in the membership group now"):
        ask(Move(1, state.epoch, to="zz"))
    to = next(n for n in "abc" if n not in state.targets()[2])
    cluster.append(ask(Move(2, state.epoch, to=to)))
    cluster.append(ask(Move(2, state.epoch, unpin=True)))
    assert 2 not in state.pins
    cluster.append(ask(Drain("a", state.epoch)))
    assert ask(Drain("a", state.epoch)) == []  # drained already


def test_a_retired_copy_targeted_again_rejoins_and_a_new_cluster_waits_for_every_report() -> None:
    cluster = Cluster(["a", "b", "c"], shards=3, r=2)
    cluster.now += ROUND_MS
    cluster.controller.members_listed(["a", "b", "c"], cluster.now)
    cluster.now += 2 * ROUND_MS
    cluster.controller.members_listed(["a", "b", "c"], cluster.now)
    cluster.controller.report(NodeReport("a", "", {}, cluster.now))
    assert cluster.controller.plan(cluster.state, cluster.now) == []  # b and c have not reported
    cluster.settle()
    shard = 0
    giver = cluster.state.targets()[shard][0]
    retire = placement_pb2.PlacementRecord(step=placement_pb2.CopyStep(  # as an older controller left it
        shard=shard, node_id=giver, kind=placement_pb2.COPY_STEP_KIND_RETIRE))
    assert cluster.state.apply(cluster.state.position, retire.SerializeToString()) is None
    cluster.follow()
    records = cluster.round()
    assert any(r.step.kind == placement_pb2.COPY_STEP_KIND_REJOIN and r.step.node_id == giver for r in records)


def test_a_round_appends_a_bounded_number_of_records_and_the_mutation_counts_everything_ready() -> None:
    from kvstore.core.placement_controller import DROP_BEFORE_CAUGHT_UP, MAX_RECORDS_PER_ROUND
    cluster = Cluster([f"n{i}" for i in range(40)], shards=200, r=3, learners=64)
    for _ in range(4):
        records = cluster.round()
        assert len(records) <= MAX_RECORDS_PER_ROUND
    mutated = PlacementController("c", "c:1", 1, cluster.settings, cluster.now, mutations=frozenset(
        {DROP_BEFORE_CAUGHT_UP}))
    learning = next(s for s, copies in cluster.state.copies.items() if CopyState.LEARNER in copies.values())
    assert mutated.ready(cluster.state, learning, cluster.now) >= {
        n for n, c in cluster.state.copies_of(learning).items() if c is CopyState.LEARNER}


def test_the_follower_keeps_what_the_log_does_not_mention_and_the_mutation_drops_it() -> None:
    from kvstore.core.placement_follower import DROP_REOPENED_COPY
    state = PlacementState()
    found = {3: Local(True, False, True, found_at_start=True)}
    assert placement_follower.acts(state, "a", found) == []
    assert placement_follower.acts(state, "a", found, mutations=frozenset({DROP_REOPENED_COPY})) == [(3, Act.DROP)]
    assert placement_follower.acts(state, "a", {3: Local(True, True, True)}) == [(3, Act.LEAVE)]
