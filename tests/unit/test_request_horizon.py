"""`kvstore.core.request_horizon.expired`: when a request id the table does not hold must be refused."""

from __future__ import annotations

import pytest

from kvstore import limits
from kvstore.core.request_horizon import expired

NOW = 1_700_000_000_000  # the leader's clock, Unix ms
H = 3_600_000  # horizon
S = 10_000  # clock skew
E = NOW - 600_000  # evicted through: the table forgot an id stamped ten minutes ago
OLD = "beyond the"
FORGOTTEN = "newest request id this shard has forgotten"


@pytest.mark.parametrize(
    ("first_attempt", "evicted_through", "refused"),
    [
        # nothing forgotten yet: only the horizon refuses
        pytest.param(NOW, 0, None, id="fresh-nothing-forgotten"),
        pytest.param(NOW - H, 0, None, id="exactly-at-horizon"),
        pytest.param(NOW - H - 1, 0, OLD, id="just-beyond-horizon"),
        pytest.param(1, 0, OLD, id="epoch"),
        pytest.param(-5, 0, OLD, id="negative-is-older-than-any-horizon"),
        # something forgotten: could the first attempt be as old as a forgotten id?
        pytest.param(NOW - 1_000, E, None, id="after-evicted-plus-skew"),
        pytest.param(E + S + 1, E, None, id="just-after-evicted-plus-skew"),
        pytest.param(E + S, E, FORGOTTEN, id="at-evicted-plus-skew"),
        pytest.param(E, E, FORGOTTEN, id="at-evicted"),
        pytest.param(E - 5 * 60_000, E, FORGOTTEN, id="before-evicted-within-horizon"),
        pytest.param(NOW - H - 1, E, OLD, id="beyond-horizon-says-horizon-first"),
        # the table forgets ids younger than the skew (count bound under heavy load, or an evicted
        # id stamped by a leader whose clock ran ahead of ours): even a fresh request may be a retry
        pytest.param(NOW, NOW - S, FORGOTTEN, id="fresh-but-table-churns-faster-than-skew"),
        pytest.param(NOW, NOW - S - 1, None, id="fresh-table-churn-just-slower-than-skew"),
        pytest.param(NOW, NOW + 5_000, FORGOTTEN, id="evicted-stamped-ahead-of-our-clock"),
        # 0 = not given: taken as now, so only a table churning within the skew refuses it
        pytest.param(0, 0, None, id="not-given"),
        pytest.param(0, E, None, id="not-given-gets-no-expiry-protection"),
        pytest.param(0, NOW - S, FORGOTTEN, id="not-given-table-churns-within-skew"),
        # a client clock ahead of ours: up to the skew taken as given, beyond it taken as now
        pytest.param(NOW + S, NOW - 1, None, id="ahead-within-skew-taken-as-given"),
        pytest.param(NOW + S + 1, NOW - S, FORGOTTEN, id="ahead-beyond-skew-taken-as-now"),
        pytest.param(NOW + 10 * H, 0, None, id="far-future-is-now-not-old"),
        pytest.param(NOW + 10 * H, E, None, id="far-future-after-evicted"),
    ],
)
def test_expired(first_attempt: int, evicted_through: int, refused: str | None) -> None:
    why = expired(first_attempt, NOW, evicted_through, H, S)
    if refused is None:
        assert why is None
    else:
        assert why is not None and why.startswith("request id expired, outcome unknown") and refused in why


def test_zero_skew_is_an_exact_comparison() -> None:
    assert expired(E, NOW, E, H, 0) is not None
    assert expired(E + 1, NOW, E, H, 0) is None


def test_the_reason_names_the_numbers() -> None:
    assert expired(NOW - H - 7, NOW, 0, H, S) == (
        f"request id expired, outcome unknown: first attempted {H + 7} ms ago, beyond the {H} ms request-id horizon")
    why = expired(E, NOW, E, H, S)
    assert why is not None and str(E) in why and str(S) in why


@pytest.mark.parametrize(
    ("now", "evicted_through", "horizon", "skew"),
    [
        pytest.param(0, 0, H, S, id="no-clock"),
        pytest.param(NOW, -1, H, S, id="negative-evicted"),
        pytest.param(NOW, 0, 0, S, id="no-horizon"),
        pytest.param(NOW, 0, H, -1, id="negative-skew"),
    ],
)
def test_refuses_server_side_nonsense(now: int, evicted_through: int, horizon: int, skew: int) -> None:
    with pytest.raises(AssertionError):
        expired(NOW, now, evicted_through, horizon, skew)


def test_the_documented_constants() -> None:
    assert (limits.REQUEST_ID_HORIZON_MS, limits.MAX_REQUEST_IDS, limits.MAX_CLOCK_SKEW_MS) == (
        3_600_000, 100_000, 10_000)
    # a retry within its client's deadline, a minute or a quarter of an hour later is never "too old"
    for age_ms in (5_000, 60_000, 15 * 60_000):
        assert expired(NOW - age_ms, NOW, 0, limits.REQUEST_ID_HORIZON_MS, limits.MAX_CLOCK_SKEW_MS) is None
