"""The rounds of one WriteBatch call, as a machine without I/O: `Client.write_batch` and
`AsyncClient.write_batch` drive the same one (h11's style: the caller does the sending, the
sleeping and the routing cache; this decides).

Each round sends every pending part to its shard's leader (one call per node, the parts of one
node together). Each part keeps the `AttemptLog` a Put keeps, so its attempts add up exactly as
a Put's do: it leaves the rounds committed, failed for good (FAIL), or when the rounds or the
deadline run out; an attempt whose outcome was unknown is never turned into a definite failure
by a later one, a part still pending when the deadline passed after such an attempt ends
`UnknownOutcome`, and a part ends `Unreachable` only when none of its attempts reached a node
(W7). A call the transport lost without a gRPC status (`CallLost`: a channel closed under it)
is an unknown outcome for its parts when it may have been sent.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

import grpc
from google.protobuf.message import Message

from kvstore.client.errors import (
    BatchIncomplete,
    KvError,
    NotLeader,
    RequestExpired,
    UnknownOutcome,
    error_from_rpc,
    error_from_status,
    status_code,
)
from kvstore.client.results import BatchResult, ShardMap, ShardWrite
from kvstore.client.retry import AttemptLog, RetryAction, capped_attempt_error
from kvstore.v1 import kv_pb2


@dataclasses.dataclass(frozen=True)
class CallLost:
    """A call of a round that ended without an answer or a gRPC status (the channel closed under
    it, the runtime refused it): `sent` when it may have reached the node."""

    reason: str
    sent: bool


Answer: TypeAlias = Message | grpc.RpcError | CallLost  # one node's answer to its call of a round, or its failure


@dataclasses.dataclass
class RoundOutcome:
    """What the caller does after a round: forget its shard map, move "any node" past these
    nodes, back off before the next round."""

    invalidate_map: bool = False
    rotate: list[str] = dataclasses.field(default_factory=list)
    backoff: bool = False
    retry_info: KvError | None = None  # the error whose server-asked delay (RetryInfo) is the longest


class BatchRounds:
    """The bookkeeping of one batch's rounds (see the module's docstring). `max_attempts` bounds
    the rounds; `attempt_timeout_s` is the cap one round's calls were given (a call cut off by it
    while the deadline had room is "not answering": outcome unknown, like a Put's attempt)."""

    def __init__(self, parts: Mapping[int, kv_pb2.ShardMutations], *, max_attempts: int,
                 attempt_timeout_s: float) -> None:
        assert parts and max_attempts >= 1 and attempt_timeout_s > 0
        self.pending: dict[int, kv_pb2.ShardMutations] = dict(parts)
        self.committed: dict[int, ShardWrite] = {}
        self.failed: dict[int, KvError] = {}
        self.attempt = 0
        self._max_attempts = max_attempts
        self._attempt_timeout_s = attempt_timeout_s
        self._logs = {shard: AttemptLog(write=True, request_id=part.request_id) for shard, part in parts.items()}
        self._hints: dict[int, str] = {}  # shard -> the node its next attempt goes to

    def more(self, remaining_s: float) -> bool:
        """Whether another round may start, with `remaining_s` left of the deadline."""
        return bool(self.pending) and self.attempt < self._max_attempts and remaining_s > 0

    def start(self, smap: ShardMap | None, any_endpoint: Callable[[], str]) -> list[tuple[str, list[int]]]:
        """A new round: the pending parts grouped by the node each goes to (a hint it was given,
        else its shard's leader in `smap`, else any node, which forwards)."""
        assert self.pending, "a round with nothing pending"
        self.attempt += 1
        groups: dict[str, list[int]] = {}
        for shard in sorted(self.pending):
            self._logs[shard].started()
            target = self._hints.pop(shard, None) or (smap.leader_of(shard) if smap else None) or any_endpoint()
            groups.setdefault(target, []).append(shard)
        return list(groups.items())

    def requests(self, groups: Sequence[tuple[str, list[int]]]) -> list[tuple[str, kv_pb2.WriteBatchRequest]]:
        """Each node's call of the round."""
        return [(target, kv_pb2.WriteBatchRequest(shards=[self.pending[s] for s in shards]))
                for target, shards in groups]

    def absorb(self, groups: Sequence[tuple[str, list[int]]], answers: Sequence[Answer], *,
               capped: bool) -> RoundOutcome:
        """The round's answers, in the order of `groups`. `capped`: its calls were cut off at
        `attempt_timeout_s` with more of the deadline left."""
        assert len(groups) == len(answers), (len(groups), len(answers))
        outcome = RoundOutcome()
        for (target, shards), answer in zip(groups, answers, strict=True):
            for shard, error in self._part_errors(target, shards, answer, capped).items():
                log = self._logs[shard]
                action = log.failed(error)
                if action is RetryAction.FAIL:
                    self.failed[shard] = log.raised(error)
                    del self.pending[shard]
                    continue
                if action is RetryAction.REDIRECT:
                    assert isinstance(error, NotLeader)
                    outcome.invalidate_map = True
                    if error.leader_hint and error.leader_hint != target:
                        self._hints[shard] = error.leader_hint  # a fresh node: no reason to wait
                        continue
                elif action is RetryAction.REROUTE:
                    outcome.invalidate_map = True
                    if target not in outcome.rotate:
                        outcome.rotate.append(target)
                else:  # BACKOFF: the same node again
                    self._hints[shard] = target
                outcome.backoff = True
                if error.retry_delay_s is not None and (outcome.retry_info is None or error.retry_delay_s
                                                        > (outcome.retry_info.retry_delay_s or 0)):
                    outcome.retry_info = error
        outcome.backoff = outcome.backoff and bool(self.pending) and self.attempt < self._max_attempts
        return outcome

    def closed(self, error: KvError) -> None:
        """The client was closed under the round: nothing was sent this time; every pending part
        ends with `error` (or the unknown outcome an earlier round left it)."""
        for shard, part in self.pending.items():
            own = copy.copy(error)
            own.request_id = part.request_id
            self.failed[shard] = self._logs[shard].raised(own)
        self.pending.clear()

    def finish(self, *, deadline_passed: bool) -> tuple[dict[int, ShardWrite], dict[int, KvError]]:
        """The parts committed and why each other did not: out of rounds or of time, a pending
        part ends as a Put that gave up would (`AttemptLog.gave_up`)."""
        for shard in self.pending:
            self.failed[shard] = self._logs[shard].gave_up(deadline_passed=deadline_passed)
        self.pending.clear()
        return self.committed, self.failed

    def _part_errors(self, target: str, shards: list[int], answer: Answer, capped: bool) -> dict[int, KvError]:
        """One node's answer for its parts: committed parts move from `pending` to `committed`;
        the others' errors are returned. A failed call fails each of its parts alike."""
        errors: dict[int, KvError] = {}
        if isinstance(answer, CallLost):
            for shard in shards:
                rid = self.pending[shard].request_id
                errors[shard] = (
                    UnknownOutcome(f"{target}: {answer.reason}; the call may have reached it", target=target,
                                   request_id=rid) if answer.sent else
                    KvError(f"{target}: {answer.reason}; nothing was sent", target=target, request_id=rid))
            return errors
        if isinstance(answer, grpc.RpcError):
            for shard in shards:
                error = error_from_rpc(answer, target=target, request_id=self.pending[shard].request_id, write=True)
                errors[shard] = capped_attempt_error(error, capped=capped, attempt_timeout_s=self._attempt_timeout_s)
            return errors
        if not isinstance(answer, kv_pb2.WriteBatchResponse):
            raise KvError(f"unexpected response from {target}: {type(answer).__name__}", target=target)
        for result in answer.results:
            shard = result.shard
            if shard not in shards or shard not in self.pending:
                continue  # not a part of this call: ignored (the part stays pending)
            rid = self.pending[shard].request_id
            if result.HasField("error"):
                e = result.error
                errors[shard] = error_from_status(status_code(e.code), e.message, dict(e.metadata), target=target,
                                                  request_id=rid, write=True)
            else:
                self.committed[shard] = ShardWrite.from_pb(result, rid)
                del self.pending[shard]
        for shard in shards:
            if shard in self.pending and shard not in errors:
                errors[shard] = UnknownOutcome(f"{target} answered without a result for shard {shard}",
                                               target=target, request_id=self.pending[shard].request_id)
        return errors


def batch_result(parts: Mapping[int, kv_pb2.ShardMutations], committed: Mapping[int, ShardWrite],
                 failed: Mapping[int, KvError], request_id: str, first_attempt_unix_ms: int) -> BatchResult:
    """The batch's answer: its result when every part committed, else `BatchIncomplete` naming
    the parts that did and why each other did not."""
    if failed:
        unknown = [s for s, e in failed.items() if isinstance(e, UnknownOutcome | RequestExpired)]
        first = min(failed)
        raise BatchIncomplete(
            f"{len(failed)} of {len(parts)} parts not committed (shards {sorted(failed)}"
            f"{f', outcome unknown for {unknown}' if unknown else ''}); shard {first}: {failed[first].message}",
            committed=dict(committed), errors=dict(failed), request_id=request_id,
            first_attempt_unix_ms=first_attempt_unix_ms)
    return BatchResult(tuple(committed[s] for s in sorted(committed)), request_id)
