"""`python -m tests.robustness --duration 300 --seed 7 --out .data/soak/7` (what `make soak` runs).

Exit status: 0 when every check passed, 1 when a check found an anomaly (the run's directory keeps
every log, the history and the WAL), 2 when the campaign could not run (not root, no Kafka jars).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from tests.robustness import campaign
from tests.robustness.net import NetworkError, require_root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make soak", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of faults and workloads (default 300)")
    parser.add_argument("--seed", default="random", help="the faults' seed (default: a fresh one, printed)")
    parser.add_argument("--out", type=Path, default=None, help="the run's directory (default .data/soak/<seed>)")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4,
                        help="a multiplier of the workloads' client threads (default 4; 8 for the most operations)")
    parser.add_argument("--no-faults", action="store_true", help="the same run without faults (a baseline)")
    parser.add_argument("--no-audit", action="store_true", help="skip `kvstore audit` (Spark) after the run")
    parser.add_argument("--snapshot", choices=("auto", "yes", "no"), default="auto",
                        help="take a snapshot and truncate the WAL mid-run (auto: runs of 240 s or more)")
    parser.add_argument("--keep", action="store_true", help="keep the WAL and the nodes' data of a passing run")
    args = parser.parse_args(argv)
    if args.duration < 20:
        parser.error("--duration must be at least 20 s (a fault needs time to start and end)")
    try:
        require_root()
    except NetworkError as exc:
        print(f"make soak: {exc}", file=sys.stderr)
        return 2
    seed = int(time.time() * 1000) % 1_000_000 if args.seed == "random" else int(args.seed)
    random.seed(seed)
    out = args.out or Path(".data") / "soak" / str(seed)
    print(f"soak: seed {seed} (replay: make soak SEED={seed} DURATION={int(args.duration)})", flush=True)
    result = campaign.run(campaign.Settings(
        duration_s=args.duration, seed=seed, out=out.resolve(), shards=args.shards, audit=not args.no_audit,
        faults=not args.no_faults, clients=args.clients, keep=args.keep,
        snapshot={"auto": None, "yes": True, "no": False}[args.snapshot]))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
