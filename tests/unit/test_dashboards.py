"""The Grafana dashboard and the Prometheus config of docker-compose.yml, checked without Docker.

What only a running Grafana would show otherwise: a panel whose query names a metric the node
does not export (renamed, or `_total` forgotten: the panel is simply empty), a label that no
series carries, a query that does not parse, a panel pointing at a datasource uid nobody
provisioned, a Prometheus that scrapes the wrong port or a node that does not exist, a mount of a
file that is not in the repository.

The metric names and labels are those a `kvstore.server.metrics.Metrics()` registry exposes
(every labelled metric touched once, then collected), so renaming a metric fails here. PromQL is
checked by a small parser of the subset dashboards use (selectors, functions, aggregations,
binary operators) that also types it: `rate` of an instant vector, or `histogram_quantile` over
buckets aggregated without `le`, are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from kvstore.server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvstore.json"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
GRAFANA_PROVISIONING = DEPLOY / "grafana" / "provisioning"
NODES = ("node-1", "node-2", "node-3")
PROMETHEUS, GRAFANA = "prometheus", "grafana"
PROMETHEUS_PORT, GRAFANA_PORT = 9090, 3000  # what the images listen on
PROMETHEUS_CONFIG_PATH = "/etc/prometheus/prometheus.yml"  # prom/prometheus's default --config.file
GRAFANA_PROVISIONING_PATH = "/etc/grafana/provisioning"  # the grafana image's GF_PATHS_PROVISIONING
# Labels Prometheus adds to every scraped series, besides those of the static configs.
TARGET_LABELS = frozenset({"job", "instance"})
# Labels the dashboard may use before the node registers them: issue 13 adds the ErrorInfo reason
# to the request counter (the panel also groups by code, so it is useful without). Redundant once
# kvstore/server/metrics.py has it; kept so this test does not depend on which change lands first.
PENDING_LABELS = {"kvstore_requests_total": frozenset({"reason"})}
# Grafana's built-in variables (in ranges they stand for a duration).
GRAFANA_DURATIONS = ("$__rate_interval", "$__interval", "$__range")


# ---- what the node exports -----------------------------------------------------------------------


@functools.cache
def exported() -> dict[str, frozenset[str]]:
    """Sample name -> its label names, as a node's /metrics shows them (`_total`, `_bucket`+`le`, ...)."""
    metrics = Metrics()
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*["x"] * len(metric._labelnames))  # a child, so the family has samples
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in names.items()}


def labels_of(metric: str) -> frozenset[str]:
    return exported()[metric] | TARGET_LABELS | static_labels() | PENDING_LABELS.get(metric, frozenset())


def test_the_registry_reading_sees_every_kind_of_metric() -> None:
    """Guards the helper: if prometheus_client changed how it collects, everything else would pass vacuously."""
    names = exported()
    assert {"kvstore_commit_latency_seconds_bucket", "kvstore_requests_total", "kvstore_lag_records",
            "kvstore_group_leaves_total"} <= set(names)
    assert "le" in names["kvstore_commit_latency_seconds_bucket"]
    assert {"method", "code"} <= names["kvstore_requests_total"]


# ---- PromQL: a parser of the subset dashboards use -------------------------------------------------

SCALAR, STRING, INSTANT, RANGE = "scalar", "string", "instant vector", "range vector"
FUNCTIONS: dict[str, tuple[tuple[str, ...], str]] = {  # name -> (argument types, result type)
    **{name: ((RANGE,), INSTANT) for name in (
        "rate", "irate", "increase", "delta", "idelta", "deriv", "changes", "resets", "avg_over_time",
        "min_over_time", "max_over_time", "sum_over_time", "count_over_time", "last_over_time",
        "stddev_over_time", "absent_over_time", "present_over_time")},
    **{name: ((INSTANT,), INSTANT) for name in (
        "abs", "ceil", "floor", "exp", "ln", "log2", "log10", "sqrt", "sort", "sort_desc", "timestamp", "absent")},
    "quantile_over_time": ((SCALAR, RANGE), INSTANT),
    "histogram_quantile": ((SCALAR, INSTANT), INSTANT),
    "clamp_min": ((INSTANT, SCALAR), INSTANT), "clamp_max": ((INSTANT, SCALAR), INSTANT),
    "clamp": ((INSTANT, SCALAR, SCALAR), INSTANT), "round": ((INSTANT, SCALAR), INSTANT),
    "label_replace": ((INSTANT, STRING, STRING, STRING, STRING), INSTANT),
    "vector": ((SCALAR,), INSTANT), "scalar": ((INSTANT,), SCALAR), "time": ((), SCALAR),
}
AGGREGATIONS = {"sum": None, "avg": None, "min": None, "max": None, "count": None, "group": None,
                "stddev": None, "stdvar": None, "topk": SCALAR, "bottomk": SCALAR, "quantile": SCALAR,
                "count_values": STRING}  # name -> type of the parameter before the vector, if any
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "and", "or", "unless"}
BINARY = {"+", "-", "*", "/", "%", "^", "==", "!=", ">", "<", ">=", "<=", "and", "or", "unless"}
TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<duration>(?<=\[)\s*(?:\d+(?:ms|[smhdwy]))+\s*(?=\]))
  | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=])
  | (?P<punct>[(){}\[\],])
""", re.VERBOSE)


@dataclasses.dataclass
class Selector:
    metric: str
    matchers: list[tuple[str, str, str]]  # (label, operator, value)


@dataclasses.dataclass
class Node:
    type: str
    selectors: list[Selector] = dataclasses.field(default_factory=list)
    functions: list[str] = dataclasses.field(default_factory=list)
    groupings: list[tuple[str, list[str], list[Selector]]] = dataclasses.field(default_factory=list)
    aggregated_by: list[str] | None = None  # the outermost node's `by (...)`, if an aggregation

    def absorb(self, other: Node) -> None:
        self.selectors += other.selectors
        self.functions += other.functions
        self.groupings += other.groupings


def tokenize(expr: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(expr):
        match = TOKEN.match(expr, pos)
        if not match:
            raise SyntaxError(f"unexpected {expr[pos:pos + 10]!r} at {pos}")
        pos = match.end()
        kind = match.lastgroup
        assert kind is not None
        if kind != "ws":
            tokens.append((kind, match.group().strip()))
    return tokens


class PromQL:
    """Recursive descent over tokens; every operator one precedence level (enough to check
    syntax, types and names; not to evaluate)."""

    def __init__(self, expr: str) -> None:
        self.tokens = tokenize(expr)
        self.pos = 0

    @classmethod
    def parse(cls, expr: str) -> Node:
        parser = cls(expr)
        node = parser.expr()
        if parser.pos != len(parser.tokens):
            raise SyntaxError(f"trailing {parser.tokens[parser.pos:]}")
        return node

    def peek(self, offset: int = 0) -> tuple[str, str]:
        i = self.pos + offset
        return self.tokens[i] if i < len(self.tokens) else ("end", "")

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        got_kind, got = self.peek()
        if (value is not None and got != value) or (kind is not None and got_kind != kind):
            raise SyntaxError(f"expected {value or kind}, got {got!r} at token {self.pos}")
        self.pos += 1
        return got

    def label_list(self) -> list[str]:
        self.take("(")
        labels = []
        while self.peek()[1] != ")":
            labels.append(self.take(kind="ident"))
            if self.peek()[1] != ")":
                self.take(",")
        self.take(")")
        return labels

    def expr(self) -> Node:
        left = self.unary()
        while self.peek()[1] in BINARY and self.peek()[0] in ("op", "ident"):
            op = self.take()
            if self.peek()[1] == "bool":
                self.take()
            if self.peek()[1] in ("on", "ignoring"):
                self.take()
                self.label_list()
                if self.peek()[1] in ("group_left", "group_right"):
                    self.take()
                    if self.peek()[1] == "(":
                        self.label_list()
            right = self.unary()
            for side in (left, right):
                if side.type not in (SCALAR, INSTANT):
                    raise TypeError(f"{op}: operand is a {side.type}")
            result = Node(INSTANT if INSTANT in (left.type, right.type) else SCALAR)
            result.absorb(left)
            result.absorb(right)
            left = result
        return left

    def unary(self) -> Node:
        if self.peek()[1] in ("-", "+"):
            self.take()
        node = self.primary()
        if self.peek()[1] == "offset":
            self.take()
            self.take(kind="number")
            self.take(kind="ident")  # the unit: 5m lexes as number + ident outside brackets
        return node

    def primary(self) -> Node:
        kind, value = self.peek()
        if kind == "number":
            self.take()
            return Node(SCALAR)
        if kind == "string":
            self.take()
            return Node(STRING)
        if value == "(":
            self.take()
            node = self.expr()
            self.take(")")
            node.aggregated_by = None
            return node
        if kind != "ident" or value in KEYWORDS:
            raise SyntaxError(f"unexpected {value!r} at token {self.pos}")
        if value in AGGREGATIONS:
            return self.aggregation()
        if self.peek(1)[1] == "(":
            return self.call()
        return self.selector()

    def aggregation(self) -> Node:
        name = self.take()
        by: list[str] | None = None
        if self.peek()[1] in ("by", "without"):
            modifier = self.take()
            by = self.label_list() if modifier == "by" else None
        self.take("(")
        parameter = AGGREGATIONS[name]
        if parameter is not None:
            if self.expr().type != parameter:
                raise TypeError(f"{name}: the parameter is a {parameter}")
            self.take(",")
        inner = self.expr()
        self.take(")")
        if self.peek()[1] in ("by", "without"):
            if by is not None:
                raise SyntaxError(f"{name}: two grouping clauses")
            modifier = self.take()
            by = self.label_list() if modifier == "by" else None
        if inner.type != INSTANT:
            raise TypeError(f"{name} over a {inner.type}")
        node = Node(INSTANT, aggregated_by=by)
        node.absorb(inner)
        node.functions.append(name)
        node.groupings.append((name, by or [], inner.selectors))
        return node

    def call(self) -> Node:
        name = self.take()
        if name not in FUNCTIONS:
            raise SyntaxError(f"unknown function {name}")
        expected, result = FUNCTIONS[name]
        self.take("(")
        args: list[Node] = []
        while self.peek()[1] != ")":
            args.append(self.expr())
            if self.peek()[1] != ")":
                self.take(",")
        self.take(")")
        if tuple(arg.type for arg in args) != expected:
            raise TypeError(f"{name}({', '.join(a.type for a in args)}): expects ({', '.join(expected)})")
        if name == "histogram_quantile" and args[1].aggregated_by is not None and "le" not in args[1].aggregated_by:
            raise TypeError("histogram_quantile over buckets aggregated without `le`")
        node = Node(result)
        for arg in args:
            node.absorb(arg)
        node.functions.append(name)
        return node

    def selector(self) -> Node:
        selector = Selector(self.take(kind="ident"), [])
        if self.peek()[1] == "{":
            self.take()
            while self.peek()[1] != "}":
                label = self.take(kind="ident")
                op = self.take(kind="op")
                if op not in ("=", "!=", "=~", "!~"):
                    raise SyntaxError(f"label matcher {label}{op}")
                selector.matchers.append((label, op, self.take(kind="string")[1:-1]))
                if self.peek()[1] != "}":
                    self.take(",")
            self.take("}")
        node = Node(INSTANT, selectors=[selector])
        if self.peek()[1] == "[":
            self.take()
            self.take(kind="duration")
            self.take("]")
            node.type = RANGE
        return node


def grafana_to_promql(expr: str) -> str:
    """Grafana's interval variables stand for durations; other `$var`s only appear in strings."""
    for variable in GRAFANA_DURATIONS:
        expr = expr.replace(variable, "1m")
    return expr


@pytest.mark.parametrize(("expr", "error"), [
    ("rate(kvstore_lag_records)", TypeError),
    ("rate(kvstore_lag_records[5m]", SyntaxError),
    ("sum by (shard) (kvstore_lag_records{shard=\"0\"}", SyntaxError),
    ("histogram_quantile(0.9, sum by (shard) (rate(kvstore_batch_records_bucket[1m])))", TypeError),
    ("ratee(kvstore_lag_records[1m])", SyntaxError),
    ("kvstore_lag_records{shard~\"0\"}", SyntaxError),
    ("sum(kvstore_lag_records[1m])", TypeError),
])
def test_the_parser_refuses_what_prometheus_refuses(expr: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        PromQL.parse(expr)


# ---- reading the files -----------------------------------------------------------------------


@functools.cache
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def service(name: str) -> dict[str, Any]:
    services = compose()["services"]
    assert name in services, f"docker-compose.yml has no service {name!r}"
    return dict(services[name])


def environment(name: str) -> dict[str, str]:
    raw = service(name).get("environment", {})
    pairs = dict(item.split("=", 1) for item in raw) if isinstance(raw, list) else dict(raw)
    return {key: str(value) for key, value in pairs.items()}


def bind_mounts(name: str, *, read_only: bool = False) -> dict[str, Path]:
    """Container path -> host path, for the service's bind mounts (sources starting with . or /),
    only the read-only ones if asked."""
    mounts: dict[str, Path] = {}
    for entry in service(name).get("volumes", []):
        if isinstance(entry, dict):
            source, target, ro = str(entry.get("source", "")), str(entry["target"]), bool(entry.get("read_only"))
        else:
            source, target, *options = str(entry).split(":")
            ro = "ro" in ",".join(options).split(",")
        if source.startswith((".", "/")) and (ro or not read_only):
            mounts[target] = (COMPOSE.parent / source).resolve()
    return mounts


def host_file(name: str, container_path: str) -> Path | None:
    """The repository file a container path of the service is, through its bind mounts."""
    path = PurePosixPath(container_path)
    for target, source in bind_mounts(name).items():
        if path == PurePosixPath(target):
            return source
        if path.is_relative_to(target):
            return source / path.relative_to(target)
    return None


def published(name: str) -> dict[int, str]:
    """Container port -> `host_ip:host_port` as published."""
    result: dict[int, str] = {}
    for entry in service(name).get("ports", []):
        *host, target = str(entry).split(":")
        result[int(target)] = ":".join(host)
    return result


@functools.cache
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panels() -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for panel in dashboard()["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in panels():
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target.get('refId')}", target["expr"]


def template_variables() -> list[dict[str, Any]]:
    return list(dashboard().get("templating", {}).get("list", []))


@functools.cache
def prometheus_config() -> dict[str, Any]:
    data = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert isinstance(data, dict)
    return data


def static_configs() -> list[dict[str, Any]]:
    return [static for job in prometheus_config()["scrape_configs"] for static in job.get("static_configs", [])]


@functools.cache
def static_labels() -> frozenset[str]:
    return frozenset(label for static in static_configs() for label in static.get("labels", {}))


def provisioning(kind: str) -> list[dict[str, Any]]:
    """The entries (`datasources` or `providers`) of every provisioning file of that kind."""
    entries: list[dict[str, Any]] = []
    for path in sorted((GRAFANA_PROVISIONING / kind).glob("*.y*ml")):
        data = yaml.safe_load(path.read_text())
        assert data.get("apiVersion") == 1, path
        entries += data.get("providers" if kind == "dashboards" else kind, [])
    return entries


def parsed(where: str, expr: str) -> Node:
    try:
        return PromQL.parse(grafana_to_promql(expr))
    except (SyntaxError, TypeError) as exc:
        raise AssertionError(f"{where}: {exc}: {expr}") from exc


# ---- the dashboard -----------------------------------------------------------------------------


def test_dashboard_is_a_grafana_dashboard_with_distinct_panels() -> None:
    board = dashboard()
    assert board["uid"] == "kvstore" and board["title"]
    assert isinstance(board["schemaVersion"], int)
    assert board.get("id") is None, "a provisioned dashboard has no database id"
    ids = [panel["id"] for panel in panels()]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    titles = [panel["title"] for panel in panels()]
    assert len(titles) == len(set(titles)), "panel titles are unique"
    cells: set[tuple[int, int]] = set()
    for panel in panels():
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        x, y = grid["x"], grid["y"]
        mine = {(i, j) for i in range(x, x + grid["w"]) for j in range(y, y + grid["h"])}
        assert not cells & mine, f"{panel['title']!r} overlaps another panel"
        cells |= mine
        if panel.get("type") != "row":
            assert panel.get("targets"), f"{panel['title']!r} has no query"
            refs = [target["refId"] for target in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]


def problems(where: str, expr: str) -> list[str]:
    """What is wrong with one dashboard query, against the metrics the node exports."""
    node = parsed(where, expr)
    found = []
    if node.type not in (INSTANT, SCALAR):
        found.append(f"a panel plots an instant vector, not a {node.type}")
    if not node.selectors:
        found.append("queries no metric")
    for selector in node.selectors:
        if selector.metric not in exported():
            found.append(f"{selector.metric} is not a metric the node exports (kvstore/server/metrics.py)")
            continue
        unknown = {label for label, _, _ in selector.matchers} - labels_of(selector.metric)
        if unknown:
            found.append(f"{selector.metric} has no label {sorted(unknown)}")
        # Counters and histograms are only meaningful as rates or increases.
        if selector.metric.endswith(("_total", "_bucket", "_sum", "_count")) and \
                not {"rate", "irate", "increase"} & set(node.functions):
            found.append(f"raw counter {selector.metric}")
    for name, by, inside in node.groupings:
        known = [s.metric for s in inside if s.metric in exported()]
        carried = frozenset().union(*(labels_of(metric) for metric in known))
        if known and not set(by) <= carried:
            found.append(f"{name} by {sorted(set(by) - carried)}: no series has it")
    return [f"{where}: {problem}" for problem in found]


@pytest.mark.parametrize(("where", "expr"), list(queries()))
def test_every_query_parses_and_names_only_what_the_node_exports(where: str, expr: str) -> None:
    assert problems(where, expr) == []


@pytest.mark.parametrize("expr", [
    "sum by (shard) (rate(kvstore_w3_rejection_total[$__rate_interval]))",  # a renamed metric
    "sum by (shard) (rate(kvstore_w3_rejections[$__rate_interval]))",  # the family name, without _total
    "sum by (method) (kvstore_lag_records)",  # a label the gauge does not have
    'kvstore_lag_records{method="Put"}',
    "kvstore_leader_changes_total",  # a raw counter
])
def test_the_checks_refuse_a_wrong_query(expr: str) -> None:
    assert problems("test", expr)


def test_every_variable_a_query_uses_is_defined() -> None:
    defined = {variable["name"] for variable in template_variables()}
    for where, expr in queries():
        used = set(re.findall(r"\$\{?(\w+)", expr)) - {v.lstrip("$") for v in GRAFANA_DURATIONS}
        assert used <= defined, f"{where}: undefined variables {sorted(used - defined)}"


def test_query_variables_read_labels_the_node_series_carry() -> None:
    for variable in template_variables():
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
        assert match, f"variable {variable['name']}: {query}"
        assert match[2] in labels_of(match[1]), f"variable {variable['name']}: {match[1]} has no label {match[2]}"
        assert variable["datasource"]["uid"] == datasource_uid()


# What the issue asks the dashboard to show: (panel test, description).
def panel_exprs() -> list[tuple[str, Node]]:
    return [(where, parsed(where, expr)) for where, expr in queries()]


def uses(node: Node, metric: str, *functions: str) -> bool:
    return any(s.metric == metric for s in node.selectors) and set(functions) <= set(node.functions)


@pytest.mark.parametrize(("what", "metric", "functions"), [
    ("commit latency quantiles", "kvstore_commit_latency_seconds_bucket", ("histogram_quantile", "rate")),
    ("batch size", "kvstore_batch_records_bucket", ("histogram_quantile", "rate")),
    ("lag", "kvstore_lag_records", ()),
    ("open-transaction age", "kvstore_open_txn_age_seconds", ()),
    ("leader changes", "kvstore_leader_changes_total", ("increase",)),
    ("W3 rejections", "kvstore_w3_rejections_total", ("rate",)),
    ("requests by method", "kvstore_requests_total", ("rate",)),
    # issue 34: latency, cross-shard transactions in doubt, placement moves
    ("request latency quantiles", "kvstore_request_duration_seconds_bucket", ("histogram_quantile", "rate")),
    ("transactions in doubt", "kvstore_txn_in_doubt_oldest_seconds", ()),
    ("transaction outcomes", "kvstore_txns_total", ("rate",)),
    ("placement moves", "kvstore_placement_moves_in_progress", ()),
    ("placement decisions", "kvstore_placement_decisions_total", ("increase",)),
])
def test_dashboard_shows_what_the_issue_asks(what: str, metric: str, functions: tuple[str, ...]) -> None:
    assert any(uses(node, metric, *functions) for _, node in panel_exprs()), f"no panel plots {what}"


def test_commit_latency_is_per_shard_and_shows_p50_and_p99() -> None:
    quantiles = set()
    for panel in panels():
        for target in panel.get("targets", []):
            node = parsed(panel["title"], target["expr"])
            if uses(node, "kvstore_commit_latency_seconds_bucket", "histogram_quantile"):
                assert any("shard" in by for _, by, _ in node.groupings), target["expr"]
                quantiles.add(float(re.search(r"histogram_quantile\(\s*([\d.]+)", target["expr"])[1]))  # type: ignore[index]
                assert panel["fieldConfig"]["defaults"]["unit"] == "s", "seconds, as the metric's name says"
    assert {0.5, 0.99} <= quantiles


def test_request_latency_is_per_method_and_shows_p50_and_p99() -> None:
    quantiles = set()
    for panel in panels():
        for target in panel.get("targets", []):
            node = parsed(panel["title"], target["expr"])
            if uses(node, "kvstore_request_duration_seconds_bucket", "histogram_quantile") and \
                    any("method" in by for _, by, _ in node.groupings):
                quantiles.add(float(re.search(r"histogram_quantile\(\s*([\d.]+)", target["expr"])[1]))  # type: ignore[index]
                assert panel["fieldConfig"]["defaults"]["unit"] == "s", "seconds, as the metric's name says"
    assert {0.5, 0.99} <= quantiles


def test_errors_are_shown_by_reason() -> None:
    """Non-OK requests grouped by the ErrorInfo reason (and code: before the node labels reasons,
    the panel still splits the errors)."""
    found = False
    for where, node in panel_exprs():
        for selector in node.selectors:
            if selector.metric == "kvstore_requests_total" and ("code", "!=", "OK") in selector.matchers:
                assert any({"reason", "code"} <= set(by) for _, by, _ in node.groupings), where
                found = True
    assert found, 'no panel plots kvstore_requests_total{code!="OK"}'


# ---- datasource and provisioning ----------------------------------------------------------------


def datasource_uid() -> str:
    prometheus = [ds for ds in provisioning("datasources") if ds["type"] == "prometheus"]
    assert len(prometheus) == 1, "one provisioned Prometheus datasource"
    return str(prometheus[0]["uid"])


def test_every_panel_and_query_uses_the_provisioned_datasource() -> None:
    uid = datasource_uid()
    for panel in panels():
        for holder in (panel, *panel.get("targets", [])):
            if "datasource" in holder:
                assert holder["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        assert "datasource" in panel or panel.get("type") == "row", f"{panel['title']!r}: which datasource?"


def test_the_datasource_is_the_compose_prometheus() -> None:
    (ds,) = [ds for ds in provisioning("datasources") if ds["type"] == "prometheus"]
    match = re.fullmatch(r"http://([\w-]+):(\d+)/?", ds["url"])
    assert match and match[1] == PROMETHEUS and int(match[2]) == PROMETHEUS_PORT, ds["url"]
    assert ds.get("access", "proxy") == "proxy", "Grafana's server queries it inside the network, not the browser"
    interval = prometheus_config()["global"]["scrape_interval"]
    assert ds["jsonData"]["timeInterval"] == interval, "$__rate_interval assumes the scrape interval"


def test_the_dashboard_provider_loads_the_dashboard_file() -> None:
    providers = provisioning("dashboards")
    assert providers, "a dashboard provider"
    loaded = []
    for provider in providers:
        assert provider["type"] == "file"
        directory = host_file(GRAFANA, provider["options"]["path"])
        assert directory is not None and directory.is_dir(), f"{provider['options']['path']} is not mounted"
        loaded += sorted(directory.glob("*.json"))
    assert DASHBOARD.resolve() in loaded


# ---- docker-compose.yml ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", [PROMETHEUS, GRAFANA])
def test_the_images_are_pinned_and_their_mounts_exist(name: str) -> None:
    image = service(name)["image"]
    assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"{name}: pin a release, not {image!r}"
    assert "build" not in service(name)
    mounts = bind_mounts(name)
    assert mounts, f"{name}: its configuration is mounted from deploy/"
    for target, source in mounts.items():
        assert source.exists(), f"{name}: {source} (mounted at {target}) is not in the repository"
        assert source.is_relative_to(DEPLOY), f"{name}: mounts {source}, outside deploy/"
    assert bind_mounts(name, read_only=True) == mounts, f"{name}: mount the repository's files read-only"


def test_prometheus_and_grafana_find_their_configuration() -> None:
    assert host_file(PROMETHEUS, PROMETHEUS_CONFIG_PATH) == PROMETHEUS_CONFIG.resolve()
    assert "command" not in service(PROMETHEUS), "the image's default flags read the config mounted above"
    provisioning_path = environment(GRAFANA).get("GF_PATHS_PROVISIONING", GRAFANA_PROVISIONING_PATH)
    assert host_file(GRAFANA, provisioning_path) == GRAFANA_PROVISIONING.resolve()
    home = environment(GRAFANA).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert host_file(GRAFANA, home) == DASHBOARD.resolve()
    assert PROMETHEUS in service(GRAFANA).get("depends_on", [])


@pytest.mark.parametrize(("name", "port"), [(PROMETHEUS, PROMETHEUS_PORT), (GRAFANA, GRAFANA_PORT)])
def test_ui_is_published_on_loopback_only(name: str, port: int) -> None:
    assert published(name) == {port: f"127.0.0.1:{port}"}, "no TLS, anonymous viewers: loopback only"


def test_grafana_lets_anonymous_users_view_only() -> None:
    env = environment(GRAFANA)
    if env.get("GF_AUTH_ANONYMOUS_ENABLED") == "true":
        assert env.get("GF_AUTH_ANONYMOUS_ORG_ROLE") == "Viewer"
    for key, value in env.items():
        assert value not in ("True", "False"), f"{key}: YAML turned a boolean into {value!r}; quote it"


# ---- Prometheus: what it scrapes -----------------------------------------------------------------


def test_prometheus_scrapes_every_node_on_its_metrics_port() -> None:
    config = prometheus_config()
    scraped: dict[str, str] = {}  # host:port -> node label
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert job.get("scheme", "http") == "http"
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                assert target not in scraped, f"{target} scraped twice"
                scraped[target] = static.get("labels", {}).get("node", "")
    expected = {}
    for name in NODES:
        env = environment(name)
        assert env.get("KVSTORE_METRICS_HOST") == "0.0.0.0", f"{name}: metrics unreachable from another container"
        port = int(env["KVSTORE_METRICS_PORT"])
        assert port, f"{name}: metrics disabled"
        expected[f"{name}:{port}"] = env["KVSTORE_NODE_ID"]
    assert scraped == expected, "one target per node service, on the node's KVSTORE_METRICS_PORT, labelled node=<id>"


def test_prometheus_intervals_are_sane() -> None:
    def seconds(value: str) -> float:
        match = re.fullmatch(r"(\d+)(ms|s|m)", value)
        assert match, value
        return int(match[1]) * {"ms": 0.001, "s": 1, "m": 60}[match[2]]

    settings = prometheus_config()["global"]
    assert seconds(settings["scrape_timeout"]) <= seconds(settings["scrape_interval"])
