"""The campaign's output, from what it recorded: the JSON report (operations by outcome, faults by
kind, anomalies by kind, the seed) and a timeline plot (throughput, latency and errors per second,
the faults as bands behind them) as a self-contained SVG, so nothing beyond the standard library
is needed to draw it and any browser shows it.
"""

from __future__ import annotations

import collections
import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tests.robustness.workloads import Bucket

WIDTH, PANEL_HEIGHT, MARGIN_LEFT, MARGIN_TOP, GAP = 1200, 150, 70, 30, 40
LANE_COLORS = {0: "#f4a3a3", 1: "#a3c4f4", 2: "#b9e3a5"}


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def build(*, seed: int, duration_s: float, operations: Mapping[str, Mapping[str, int]],
          episodes: Sequence[Mapping[str, Any]], anomalies: Mapping[str, Sequence[str]], checks: Mapping[str, str],
          extra: Mapping[str, Any]) -> dict[str, Any]:
    """The report: every count derived here from the records, so its totals always agree."""
    by_outcome: collections.Counter[str] = collections.Counter()
    for outcomes in operations.values():
        by_outcome.update(outcomes)
    faults = collections.Counter(e["kind"] for e in episodes)
    failed_episodes = [e for e in episodes if e.get("error")]
    anomaly_count = sum(len(v) for v in anomalies.values())
    return {
        "seed": seed,
        "duration_s": round(duration_s, 1),
        "ok": anomaly_count == 0,
        "operations": {"total": sum(by_outcome.values()), "by_outcome": dict(sorted(by_outcome.items())),
                       "by_kind": {k: dict(v) for k, v in sorted(operations.items())}},
        "faults": {"total": len(episodes), "by_kind": dict(sorted(faults.items())),
                   "not_done": len(failed_episodes)},
        "anomalies": {"total": anomaly_count, "by_kind": {k: list(v)[:20] for k, v in sorted(anomalies.items()) if v}},
        "checks": dict(checks),
        **extra,
        "episodes": list(episodes),
    }


def _polyline(points: Sequence[tuple[float, float]], color: str) -> str:
    if not points:
        return ""
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{path}"/>'


def timeline_svg(buckets: Mapping[int, Bucket], episodes: Sequence[Mapping[str, Any]], duration_s: float,
                 title: str) -> str:
    """Three panels over the run's seconds: operations acknowledged per second, p99 latency of
    those (ms), failed and unknown operations per second; each fault episode is a band across
    all three (lane colors: processes and links red, a node's disk/clock/moves blue, the
    pipeline green)."""
    seconds = max(int(duration_s) + 1, max(buckets, default=0) + 1)
    plot_w = WIDTH - MARGIN_LEFT - 20
    height = MARGIN_TOP + 3 * (PANEL_HEIGHT + GAP) + 20

    def x(t: float) -> float:
        return MARGIN_LEFT + plot_w * min(max(t, 0.0), seconds) / seconds

    series = {
        "acknowledged ops/s": ([(s, float(buckets[s].ok)) for s in sorted(buckets)], "#1f6f3f"),
        "p99 latency (ms)": ([(s, percentile(buckets[s].latencies_ms, 0.99)) for s in sorted(buckets)], "#3155a6"),
        "failed + unknown ops/s": ([(s, float(buckets[s].failed + buckets[s].unknown)) for s in sorted(buckets)],
                                   "#b3261e"),
    }
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
             f'<text x="{MARGIN_LEFT}" y="18" font-size="13">{html.escape(title)}</text>']
    for panel, (label, (points, color)) in enumerate(series.items()):
        top = MARGIN_TOP + panel * (PANEL_HEIGHT + GAP)
        peak = max((v for _, v in points), default=0.0) or 1.0
        for e in episodes:
            start, end = float(e["started_s"]), max(float(e["ended_s"]), float(e["started_s"]) + 0.5)
            fill = LANE_COLORS.get(int(e["lane"]), "#dddddd")
            kind = html.escape(str(e["kind"]))
            parts.append(f'<rect x="{x(start):.1f}" y="{top}" width="{max(1.0, x(end) - x(start)):.1f}" '
                         f'height="{PANEL_HEIGHT}" fill="{fill}" opacity="0.45"><title>{kind} '
                         f'{html.escape(" ".join(map(str, e.get("targets", []))))} {start:.1f}-{end:.1f}s'
                         f'</title></rect>')
        parts.append(f'<rect x="{MARGIN_LEFT}" y="{top}" width="{plot_w}" height="{PANEL_HEIGHT}" fill="none" '
                     f'stroke="#888"/>')
        parts.append(f'<text x="{MARGIN_LEFT}" y="{top - 5}">{html.escape(label)} (peak {peak:.0f})</text>')
        parts.append(f'<text x="{MARGIN_LEFT - 5}" y="{top + 10}" text-anchor="end">{peak:.0f}</text>')
        parts.append(f'<text x="{MARGIN_LEFT - 5}" y="{top + PANEL_HEIGHT}" text-anchor="end">0</text>')
        parts.append(_polyline([(x(s + 0.5), top + PANEL_HEIGHT * (1 - v / peak)) for s, v in points], color))
    axis_y = MARGIN_TOP + 3 * (PANEL_HEIGHT + GAP) - GAP + 14
    step = max(1, round(seconds / 10 / 10) * 10) if seconds > 20 else 2
    for t in range(0, seconds + 1, step):
        parts.append(f'<text x="{x(t):.1f}" y="{axis_y}" text-anchor="middle">{t}s</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def markdown(result: Mapping[str, Any]) -> str:
    """The report's figures as the tables docs/robustness.md shows: `python -m tests.robustness.report
    .data/soak/<seed>/report.json`."""
    ops = result["operations"]
    lines = [f"Seed {result['seed']}, {result['duration_s']:.0f} s, {result['cluster']['brokers']} brokers, "
             f"{result['cluster']['nodes']} nodes, {result['cluster']['shards']} shards: "
             f"**{ops['total']:,} operations, {result['faults']['total']} fault episodes, "
             f"{result['anomalies']['total']} anomalies**.", "",
             "| operation | ok | failed | unknown |", "|---|---:|---:|---:|"]
    for kind, outcomes in ops["by_kind"].items():
        lines.append(f"| {kind} | {outcomes.get('ok', 0):,} | {outcomes.get('failed', 0):,} | "
                     f"{outcomes.get('unknown', 0):,} |")
    total = ops["by_outcome"]
    lines.append(f"| **all** | **{total.get('ok', 0):,}** | **{total.get('failed', 0):,}** | "
                 f"**{total.get('unknown', 0):,}** |")
    lines += ["", "| fault | episodes |", "|---|---:|"]
    lines += [f"| {kind} | {n} |" for kind, n in result["faults"]["by_kind"].items()]
    lines.append(f"| **all** | **{result['faults']['total']}** (not done as planned: {result['faults']['not_done']}) |")
    lines += ["", "| check | verdict |", "|---|---|"]
    lines += [f"| {name} | {verdict} |" for name, verdict in result["checks"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    print(markdown(json.loads(Path(sys.argv[1]).read_text())), end="")
