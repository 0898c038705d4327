"""Which cases a fuzz run generates, and how to generate the same ones again.

A red CI must be replayable and a green one must not be luck, so every run is seeded and says its
seed: `FUZZ_SEED` unset means DEFAULT_SEED (the sample `make test` runs is the same every time),
`FUZZ_SEED=random` draws a fresh one (what `make fuzz` does, so campaigns explore), and
`FUZZ_SEED=N` replays run N. Hypothesis generates from a seeded `Random` and, before a failure
(after one it shrinks against the clock), from nothing else, so with the database off (nothing
replayed from an earlier run) a seed and FUZZ_CASES fix every input.

Each test gets its own seed derived from the session's seed and its name, not from its position
in the run: one test run alone (`-k`) gets the same inputs as in the whole sample, and adding a
test or an RPC does not change the others'.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

SEED_ENV = "FUZZ_SEED"
CASES_ENV = "FUZZ_CASES"
DEFAULT_SEED = 1_800_009  # the sample's fixed seed (issue 18, item 9); any value would do
DEFAULT_CASES = 15  # per RPC and mode: the sample `make test` runs
_SEED = re.compile(r"[0-9]{1,19}")  # ASCII digits only: int() would also take "١٢" or " 12\n"


def resolve_seed(value: str | None, draw: Callable[[], int]) -> int:
    """The session's seed for the FUZZ_SEED value `value` (None: unset); `draw` makes a fresh one."""
    text = (value or "").strip()
    if not text:
        return DEFAULT_SEED
    if text.lower() == "random":
        return draw()
    if _SEED.fullmatch(text):
        return int(text)
    raise ValueError(f"{SEED_ENV} must be unset, 'random' or a non-negative integer of at most 19 digits, "
                     f"not {value!r}")


def resolve_cases(value: str | None) -> int:
    """The examples per test for the FUZZ_CASES value `value` (None: unset)."""
    text = (value or "").strip()
    if not text:
        return DEFAULT_CASES
    if not re.fullmatch(r"[0-9]{1,9}", text) or int(text) < 1:
        raise ValueError(f"{CASES_ENV} must be a positive integer, not {value!r}")
    return int(text)


def case_seed(session_seed: int, test_id: str) -> int:
    """The seed of one test: a function of the session's seed and the test's name only."""
    return int.from_bytes(hashlib.sha256(f"{session_seed}/{test_id}".encode()).digest()[:8], "big")


def replay_line(session_seed: int, cases: int) -> str:
    return (f"fuzz seed {session_seed}; replay with {SEED_ENV}={session_seed} {CASES_ENV}={cases} "
            f".venv/bin/python -m pytest -q tests/fuzz (one RPC: add -k)")


# Resolved once per process, so every test and the summary agree on it.
SESSION_SEED = resolve_seed(os.environ.get(SEED_ENV), lambda: secrets.randbelow(2**32))
CASES = resolve_cases(os.environ.get(CASES_ENV))


def run_cases(test_id: str, strategy: st.SearchStrategy[Any], body: Callable[[Any], None], *,
              session_seed: int | None = None, cases: int | None = None) -> None:
    """Run `body` on `cases` examples of `strategy`, seeded for `test_id` (defaults: this session's)."""

    @seed(case_seed(SESSION_SEED if session_seed is None else session_seed, test_id))
    @settings(max_examples=CASES if cases is None else cases, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(sent=strategy)
    def case(sent: Any) -> None:
        body(sent)

    case()
