"""The deterministic simulation: the correct protocol under faults, and the broken ones caught.

Budget: KVSTORE_SIM_SEEDS seeds (default 30) of KVSTORE_SIM_STEPS steps each (default 50,000):
1.5 x 10^6 steps under faults per run, plus each seed's heal phase and the other tests' runs.
More: raise either variable. A failure prints its seed and the command that replays it exactly;
KVSTORE_SIM_SEED=<n> runs that seed alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sim.faults import FaultPlan
from tests.sim.harness import SimConfig, SimResult, config_for, env_int, run
from tests.sim.kafka import KafkaVariant

STEPS = env_int("KVSTORE_SIM_STEPS", 50_000)
SEEDS = [env_int("KVSTORE_SIM_SEED", 0)] if os.environ.get("KVSTORE_SIM_SEED") else list(
    range(env_int("KVSTORE_SIM_SEEDS", 30)))
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed{seed}")
def test_simulation(seed: int, record_run: list[SimResult]) -> None:
    """W1-W7, acknowledged writes, request ids, linearizability and convergence, under faults."""
    result = run(config_for(seed, STEPS))
    record_run.append(result)
    assert result.ok, result.report(f"test_simulation and seed{seed}")
    assert result.converged


# ---- teeth: each deliberately broken variant must be caught, within a bounded number of seeds ----

TEETH_STEPS = 30_000
TEETH_SEEDS = 16

# Consequences a client or a replica sees, beyond the log-only W2 check: a leader's commit that
# is not in the WAL (W1), a replica applying what the WAL does not accept (W3/W5), lost or
# resurrected writes, a non-linearizable history, diverging replicas.
VISIBLE = ("W1:", "W3/W5", "lost write", "W7", "not linearizable", "divergence", "no convergence")

# The late-EndTxn hazard needs late EndTxns: this plan makes them the common fault.
LATE_END_TXNS = FaultPlan(late_end_txn=8, storm=4, freeze=0, crash=1)


def first_caught(record_run: list[SimResult], **variant: object) -> SimResult:
    """The first seed whose run shows a visible consequence (deterministic: always the same)."""
    for seed in range(TEETH_SEEDS):
        result = run(config_for(seed, TEETH_STEPS, **variant))
        record_run.append(result)
        if any(kind in violation for violation in result.violations for kind in VISIBLE):
            return result
    raise AssertionError(f"{variant}: no visible violation in {TEETH_SEEDS} seeds of {TEETH_STEPS} steps")


def test_without_the_w2_check_acknowledged_writes_are_lost(record_run: list[SimResult]) -> None:
    """Leaders that commit without comparing delivered offsets (the shell reports every record
    at its expected offset): a foreign record shifts a batch, the batch commits where W3 rejects
    it, and its acknowledged writes exist only on the leader."""
    found = "\n".join(first_caught(record_run, check_w2=False).violations)
    assert "W1:" in found and "lost write" in found, found


def test_without_fencing_a_zombie_commit_is_caught(record_run: list[SimResult]) -> None:
    """A broker whose init_transactions fences nobody: a paused leader wakes up and commits (or
    is told it committed) a transaction that is no longer its own; it applies a batch the WAL
    does not have."""
    found = "\n".join(first_caught(record_run, kafka=KafkaVariant(fencing=False)).violations)
    assert "W1:" in found or "lost write" in found, found


def test_without_kip890_a_late_end_txn_is_caught(record_run: list[SimResult]) -> None:
    """Transaction protocol v1: a late EndTxn of an earlier transaction lands on a later one of
    the same producer and commits part of a batch its leader then aborts: a write reported as
    definitely failed took effect."""
    result = first_caught(record_run, kafka=KafkaVariant(kip890=False), faults=LATE_END_TXNS)
    found = "\n".join(result.violations)
    assert "W7" in found or "not linearizable" in found or "lost write" in found, found


# ---- determinism -------------------------------------------------------------------------------------


def test_a_seed_replays_exactly_in_another_process(record_run: list[SimResult]) -> None:
    """Same seed, same run: here twice, and in a fresh interpreter with another hash seed (no
    iteration order may depend on PYTHONHASHSEED)."""
    config = config_for(3, 8_000)
    first, second = run(config), run(config)
    record_run += [first, second]
    assert first.digest == second.digest
    code = ("from tests.sim.harness import config_for, run; "
            "print(run(config_for(3, 8_000)).digest)")
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == first.digest


def test_the_faults_reach_the_protocol(record_run: list[SimResult]) -> None:
    """Guard against a vacuous simulation: over a few seeds, every hazard the checks are about
    actually happens (fencings, unknown outcomes, W2 aborts, W3 rejections, late EndTxns
    refused, duplicate produces, expired members, crashes with disk loss)."""
    counters = ("append_fenced", "append_aborted", "append_unknown_fenced", "w3_mismatch", "w3_malformed",
                "broker_late_end_txn_refused", "broker_duplicate_produces", "broker_init_aborts",
                "group_expirations", "fault_crash", "fault_pause", "leaderships", "op_ok", "replicas_forgetting_ids")
    totals: dict[str, int] = {}
    for seed in range(12):  # bounded: some hazards are rare per seed, each shows within a few
        result = run(config_for(seed, 40_000))
        record_run.append(result)
        assert result.ok, result.report("test_the_faults_reach_the_protocol")
        for name, value in result.stats.items():
            totals[name] = totals.get(name, 0) + value
        if all(totals.get(counter, 0) > 0 for counter in counters):
            break
    for counter in counters:
        assert totals.get(counter, 0) > 0, f"{counter} never happened in {seed + 1} seeds: {totals}"


def test_config_is_what_the_seed_says() -> None:
    assert config_for(5, 10) == config_for(5, 10)
    assert isinstance(config_for(5, 10), SimConfig)
