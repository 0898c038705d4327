"""When a request id that the store does not remember must be refused (docs/design.md §4.1, W7).

The request-id table forgets ids by time and by count (`kvstore.storage.shard_store`), identically on every
replica, and records `evicted_through_ms`: the largest leader time of any id it ever forgot. A
write whose id is *not* in the table is either new or a retry of a forgotten id; applying the
latter would apply the request twice. This module decides, from clocks alone, when the second
case cannot be ruled out; the caller then refuses the write as "expired, outcome unknown"
(`errors.RequestExpiredError`). Pure: no I/O, no clock reads, so it is table-tested.
"""

from __future__ import annotations


def expired(first_attempt_unix_ms: int, now_unix_ms: int, evicted_through_ms: int, horizon_ms: int,
            skew_ms: int) -> str | None:
    """Why a write whose request id is NOT in the table must be refused, or None to let it through.

    - `first_attempt_unix_ms`: when the client first sent this request id (the client's clock);
      0 means "not given" and is taken as `now_unix_ms`: such a write is refused only while the
      table is forgetting ids younger than the skew margin. A retry that omits the time therefore
      gets no expiry protection beyond the table itself: if its id was forgotten, it is applied
      again. Clients that retry must send it.
    - `now_unix_ms`: the deciding leader's clock.
    - `evicted_through_ms`: the largest leader time of an id the table ever forgot (0: none).
    - `horizon_ms`, `skew_ms`: `limits.REQUEST_ID_HORIZON_MS`, `limits.MAX_CLOCK_SKEW_MS`.

    Refused when either holds:
    1. Older than the documented horizon: `now - first_attempt > horizon_ms`. This is the promise
       clients can read in the docs, whatever the table's state.
    2. It could be a forgotten id: `first_attempt <= evicted_through_ms + skew_ms`. Had the first
       attempt committed, it committed at a leader time C >= first_attempt - skew_ms (the commit
       follows the first attempt, and the two clocks differ by at most skew_ms); had its id been
       forgotten, C <= evicted_through_ms. So an id first attempted after
       evicted_through_ms + skew_ms cannot have been forgotten: absent from the table, it never
       committed, and applying it is its first and only apply.

    A first attempt more than `skew_ms` in the future is clock skew beyond the bound (a client
    whose clock runs fast): it is taken as `now_unix_ms`, so a fast clock can never put a retry
    beyond rule 2's reach. A negative first attempt is older than any horizon: refused by rule 1.
    """
    assert now_unix_ms > 0, f"now {now_unix_ms} ms is not a Unix time"
    assert horizon_ms > 0 and skew_ms >= 0, f"horizon {horizon_ms} ms, skew {skew_ms} ms"
    assert evicted_through_ms >= 0, f"evicted through {evicted_through_ms} ms"
    first_ms = first_attempt_unix_ms
    if first_ms == 0 or first_ms > now_unix_ms + skew_ms:
        first_ms = now_unix_ms
    age_ms = now_unix_ms - first_ms
    if age_ms > horizon_ms:
        return (f"request id expired, outcome unknown: first attempted {age_ms} ms ago, beyond the "
                f"{horizon_ms} ms request-id horizon")
    if first_ms <= evicted_through_ms + skew_ms:
        return (f"request id expired, outcome unknown: first attempted at {first_ms} ms (Unix), not "
                f"after {evicted_through_ms} ms + {skew_ms} ms of clock skew, the newest request id "
                f"this shard has forgotten")
    return None
