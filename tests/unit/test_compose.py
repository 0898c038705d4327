"""docker-compose.yml, Dockerfile and .dockerignore, checked without a Docker engine (CI has none).

These catch what review misses and only `docker compose up` would show: the Kafka image drifting
from the pinned release, broker settings drifting from `wal.broker.BROKER_SETTINGS`, a KVSTORE_*
variable the node never reads (the node refuses to start on one), nodes that
disagree on the cluster or the shard count, an advertised address that is not the node's own, a
session timeout the broker refuses, an image that runs something else or ships stale stubs, a
snapshot job that writes where the nodes do not look, an image without Java or the pipeline's jars.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import os
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from kvstore.cli import ENDPOINTS_ENV, build_parser
from kvstore.server.config import NodeConfig
from wal.broker import BROKER_SETTINGS, KAFKA_VERSION, _replication_settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
NODES = ("node-1", "node-2", "node-3")
KAFKA = "kafka"
SNAPSHOT = "snapshot"  # the one-shot Spark job (profile `pipeline`)
PIPELINE_PROFILE = "pipeline"
GROUP_MAX_SESSION_TIMEOUT_MS_DEFAULT = 1_800_000  # the broker's default group.max.session.timeout.ms
NODE_FIELDS = {NodeConfig.env_name(name) for name in NodeConfig.model_fields}


# ---- reading the files -----------------------------------------------------------------------


@functools.cache
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def service(name: str) -> dict[str, Any]:
    services = compose()["services"]
    assert name in services, f"docker-compose.yml has no service {name!r}"
    svc = services[name]
    assert isinstance(svc, dict)
    return svc


def environment(name: str) -> dict[str, str]:
    """A service's environment as strings (compose accepts a mapping or a list of K=V)."""
    raw = service(name).get("environment", {})
    pairs = dict(item.split("=", 1) for item in raw) if isinstance(raw, list) else dict(raw)
    env: dict[str, str] = {}
    for key, value in pairs.items():
        # YAML booleans and nulls are not what they look like in an environment: quote them.
        assert isinstance(value, str | int) and not isinstance(value, bool), f"{name}: {key}={value!r}"
        env[key] = interpolated(str(value))
    return env


def interpolated(value: str) -> str:
    """Compose's `${VAR:-default}` as it reads with VAR unset (what a plain `docker compose up` runs)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", lambda match: match[1], value)


def kafka_env_name(prop: str) -> str:
    """The apache/kafka image's rule: `.` -> `_`, `_` -> `__`, `-` -> `___`, upper case, KAFKA_ prefix."""
    return "KAFKA_" + "".join({".": "_", "_": "__", "-": "___"}.get(c, c) for c in prop).upper()


def listeners(value: str) -> dict[str, tuple[str, int]]:
    """`NAME://host:port,...` -> {NAME: (host, port)}."""
    result: dict[str, tuple[str, int]] = {}
    for item in value.split(","):
        name, _, address = item.strip().partition("://")
        host, _, port = address.rpartition(":")
        result[name] = (host, int(port))
    return result


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def published_ports(name: str) -> dict[int, int]:
    """container port -> host port."""
    result: dict[int, int] = {}
    for entry in service(name).get("ports", []):
        if isinstance(entry, dict):
            result[int(entry["target"])] = int(entry["published"])
        else:
            *_, published, target = str(entry).split(":")
            result[int(target)] = int(published)
    return result


def named_volume_mounts(name: str) -> dict[str, str]:
    """target path -> named volume (declared at the top level)."""
    declared = compose().get("volumes") or {}
    result: dict[str, str] = {}
    for entry in service(name).get("volumes", []):
        if isinstance(entry, dict):
            source, target = entry.get("source", ""), entry["target"]
        else:
            source, target, *_ = str(entry).split(":")
        if source in declared:
            result[target] = source
    return result


def kafka_internal_address() -> str:
    """The broker address advertised inside the network (inter-broker listener, host = the service)."""
    env = environment(KAFKA)
    advertised = listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    name = env.get("KAFKA_INTER_BROKER_LISTENER_NAME", "PLAINTEXT")
    assert name in advertised, f"the inter-broker listener {name} is not advertised"
    host, port = advertised[name]
    assert host in (KAFKA, service(KAFKA).get("hostname")), f"{name} is advertised as {host}, not the service"
    return f"{host}:{port}"


@functools.cache
def dockerfile() -> tuple[tuple[str, str], ...]:
    """(INSTRUCTION, arguments), continuation lines joined and comments dropped, as Docker does."""
    instructions: list[tuple[str, str]] = []
    current = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        keyword, _, rest = (current + line).partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continuation line"
    return tuple(instructions)


def final_stage() -> list[tuple[str, str]]:
    instructions = list(dockerfile())
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def build_stages() -> list[tuple[str, str]]:
    """Every instruction before the final stage's FROM."""
    instructions = list(dockerfile())
    return instructions[:len(instructions) - len(final_stage())]


def stage_env(stage: list[tuple[str, str]]) -> dict[str, str]:
    """A stage's ENV (KEY=value pairs)."""
    env: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            for item in shlex.split(rest):
                key, sep, value = item.partition("=")
                assert sep, f"use ENV KEY=value, not {item!r}"
                env[key] = value
    return env


def image_env() -> dict[str, str]:
    """The final stage's ENV (KEY=value pairs), which compose's environment overrides."""
    return stage_env(final_stage())


def apt_packages(stage: list[tuple[str, str]]) -> set[str]:
    """Every package an `apt-get install` in the stage names (conditional ones included)."""
    packages: set[str] = set()
    for keyword, rest in stage:
        if keyword == "RUN":
            for command in re.findall(r"apt-get install ([^&;|]+)", rest):
                packages.update(token for token in command.split() if not token.startswith("-"))
    return packages


def cli_args(argv: list[str]) -> argparse.Namespace:
    """`kvstore ARGS...` parsed by the real CLI parser (a typo in a flag fails here, not at run time)."""
    assert argv[:1] == ["kvstore"], argv
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as exc:  # argparse's way of refusing
        raise AssertionError(f"kvstore refuses {shlex.join(argv)}") from exc


# ---- Kafka -----------------------------------------------------------------------------------


def test_kafka_is_the_official_image_pinned_to_the_release_the_tests_run() -> None:
    assert service(KAFKA).get("image") == f"apache/kafka:{KAFKA_VERSION}"
    assert "build" not in service(KAFKA)


def test_kafka_runs_kraft_as_one_combined_broker_and_controller() -> None:
    env = environment(KAFKA)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    bound = listeners(env["KAFKA_LISTENERS"])
    advertised = listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert controller in bound and controller not in advertised
    assert set(advertised) <= set(bound)
    protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(bound) <= set(protocols), "every listener needs a security protocol"
    # The image formats with static voters only: this node, reachable on its controller port.
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@{KAFKA}:{bound[controller][1]}"
    # The storage tool takes only a base64 UUID (22 characters, 16 bytes).
    cluster_id = env["CLUSTER_ID"]
    assert len(cluster_id) == 22 and not cluster_id.startswith("-")
    assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


def test_kafka_settings_are_those_of_wal_broker() -> None:
    """The broker in compose is configured like the one every test runs against (one node)."""
    env = environment(KAFKA)
    expected = {**_replication_settings(1), **BROKER_SETTINGS}
    wrong = {prop: (env.get(kafka_env_name(prop)), value) for prop, value in expected.items()
             if env.get(kafka_env_name(prop)) != value}
    assert not wrong, f"docker-compose.yml differs from wal/broker.py (property: (compose, wal.broker)): {wrong}"


def test_kafka_keeps_its_log_on_a_named_volume_and_has_a_healthcheck() -> None:
    env = environment(KAFKA)
    assert env["KAFKA_LOG_DIRS"] in named_volume_mounts(KAFKA)
    test = service(KAFKA)["healthcheck"]["test"]
    assert "kafka-broker-api-versions.sh" in " ".join(test if isinstance(test, list) else [test])


# ---- the nodes -------------------------------------------------------------------------------


def node_env(name: str) -> dict[str, str]:
    """What the node process sees: the image's ENV, then the service's environment."""
    return {**image_env(), **environment(name)}


def node_config(name: str, monkeypatch: pytest.MonkeyPatch) -> NodeConfig:
    """NodeConfig.from_env exactly as `kvstore serve` runs it in the container (this validates too)."""
    with monkeypatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("KVSTORE_")]:
            patch.delenv(key)
        for key, value in node_env(name).items():
            patch.setenv(key, value)
        return NodeConfig.from_env()


def node_image() -> str:
    """The name the nodes' build is tagged with (what the snapshot service runs)."""
    images = {service(name).get("image") for name in NODES}
    assert len(images) == 1 and None not in images, f"the nodes build one named image, not {images}"
    return str(images.pop())


def test_only_the_three_nodes_build_one_named_image_from_the_repo_dockerfile() -> None:
    """The nodes build the image (the snapshot job runs it, never builds its own)."""
    built = {name for name, svc in compose()["services"].items() if "build" in svc}
    assert built == set(NODES)
    for name in NODES:
        build = service(name)["build"]
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile_name = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        assert (COMPOSE.parent / context).resolve() == ROOT
        assert (ROOT / dockerfile_name).resolve() == DOCKERFILE.resolve()
    # A name, so another service can run it; not `latest`, which `docker compose pull` refreshes.
    assert re.fullmatch(r"[a-z0-9][a-z0-9._/-]*:[\w][\w.-]*", node_image()) and not node_image().endswith(":latest")


@functools.cache
def pipeline_variables() -> frozenset[str]:
    """The KVSTORE_* names the CLI and the pipeline's code read (os.environ, by literal name)."""
    sources = [*sorted((ROOT / "kvstore" / "cli").glob("*.py")), *sorted((ROOT / "kvstore" / "pipeline").glob("*.py"))]
    names = {name for path in sources for name in re.findall(r"\bKVSTORE_[A-Z0-9_]+\b", path.read_text())}
    return frozenset(names | {ENDPOINTS_ENV})


def test_every_kvstore_variable_is_read_by_the_node() -> None:
    """from_env ignores unknown KVSTORE_* names, so a typo would silently keep the default."""
    for name in NODES:
        unknown = {key for key in environment(name) if key.startswith("KVSTORE_")} - NODE_FIELDS - {ENDPOINTS_ENV}
        assert not unknown, f"{name}: not NodeConfig fields: {sorted(unknown)}"
    # The image's own ENV serves the node and the pipeline (KVSTORE_SPARK_HOME) alike.
    unknown = {key for key in image_env() if key.startswith("KVSTORE_")} - NODE_FIELDS - pipeline_variables()
    assert not unknown, f"Dockerfile ENV: read by neither the node nor the pipeline: {sorted(unknown)}"


@pytest.mark.parametrize("name", NODES)
def test_node_identity_address_and_data(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = node_config(name, monkeypatch)
    assert config.node_id == name
    listen_host, listen_port = host_port(config.listen)
    assert listen_host == "0.0.0.0", "listen on every interface of the container"
    # Peers and clients dial the advertised address: the service name, on the port it listens on,
    # which is also the port published on the host.
    assert host_port(config.address) == (name, listen_port)
    assert published_ports(name).get(listen_port) == listen_port
    assert named_volume_mounts(name).get(str(config.data_dir)), f"{name}: data dir {config.data_dir} not on a volume"


@pytest.mark.parametrize("name", NODES)
def test_node_metrics_are_reachable_from_the_host_loopback_only(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = node_config(name, monkeypatch)
    assert config.metrics_port, "metrics enabled"
    assert config.metrics_host == "0.0.0.0", "bound to the container's interfaces, or nothing can scrape it"
    assert config.metrics_port in published_ports(name)
    published = [str(p) for p in service(name)["ports"] if str(p).endswith(f":{config.metrics_port}")]
    assert published and all(p.startswith("127.0.0.1:") for p in published), "no authentication: loopback only"


@pytest.mark.parametrize("name", NODES)
def test_a_client_on_the_host_is_routed_to_published_addresses(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34: `KVSTORE_ENDPOINTS=127.0.0.1:50051,...` from the host. Shard maps and leader
    hints name each node's client address, so it must be where the node's gRPC port is published
    on the host; the other nodes reach it at its service name inside the network."""
    config = node_config(name, monkeypatch)
    host, port = config.advertise_client.rsplit(":", 1)
    listen_port = int(config.listen.rsplit(":", 1)[1])
    assert host == "127.0.0.1" and published_ports(name).get(listen_port) == int(port), (config.advertise_client,
                                                                                        published_ports(name))
    assert config.advertise.split(":")[0] == name and int(config.advertise.rsplit(":", 1)[1]) == listen_port


def test_nodes_are_distinct(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [environment(name)["KVSTORE_NODE_ID"] for name in NODES]
    addresses = [environment(name)["KVSTORE_ADVERTISE"] for name in NODES]
    host_ports = [port for name in NODES for port in published_ports(name).values()]
    # Each its own LevelDB volume (the snapshot volume is shared on purpose: see below).
    data_volumes = [named_volume_mounts(name)[str(node_config(name, monkeypatch).data_dir)] for name in NODES]
    for values in (ids, addresses, host_ports, data_volumes):
        assert len(set(values)) == len(values), values


def snapshot_dir(monkeypatch: pytest.MonkeyPatch) -> str:
    """The nodes' KVSTORE_SNAPSHOT_DIR (one for all of them)."""
    dirs = {node_config(name, monkeypatch).snapshot_dir for name in NODES}
    assert len(dirs) == 1, f"the nodes look for snapshots in different places: {dirs}"
    return dirs.pop()


def snapshot_volume(monkeypatch: pytest.MonkeyPatch) -> str:
    """The named volume every node has at its snapshot directory (one for all of them)."""
    path = snapshot_dir(monkeypatch)
    assert path.startswith("/"), f"KVSTORE_SNAPSHOT_DIR={path!r}: a path in the container"
    volumes = {named_volume_mounts(name).get(path) for name in NODES}
    assert len(volumes) == 1 and None not in volumes, f"{path} is not one shared named volume: {volumes}"
    return str(volumes.pop())


def test_nodes_share_one_snapshot_volume_apart_from_their_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica that is empty, suspect or below a truncated WAL start loads from the same snapshots."""
    volume = snapshot_volume(monkeypatch)
    for name in NODES:
        config = node_config(name, monkeypatch)
        assert named_volume_mounts(name)[str(config.data_dir)] != volume
        # Not inside the data dir either: a wiped replica must not take the snapshots with it.
        assert not PurePosixPath(snapshot_dir(monkeypatch)).is_relative_to(config.data_dir)


def test_nodes_agree_on_everything_but_their_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cluster name, shard count, topic, Kafka, timeouts: one cluster, not three."""
    identity = {"node_id": "", "listen": "", "advertise": "", "advertise_client": "", "data_dir": Path()}
    shared = {node_config(name, monkeypatch).model_copy(update=identity)
              for name in NODES}
    assert len(shared) == 1, shared


@pytest.mark.parametrize("name", NODES)
def test_node_talks_to_the_broker_it_can_use(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = node_config(name, monkeypatch)
    kafka = environment(KAFKA)
    assert config.kafka == kafka_internal_address()
    # The group coordinator refuses a session timeout outside [min, max] (INVALID_SESSION_TIMEOUT).
    assert int(kafka["KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS"]) <= config.session_timeout_ms
    assert config.session_timeout_ms <= int(kafka.get("KAFKA_GROUP_MAX_SESSION_TIMEOUT_MS",
                                                      GROUP_MAX_SESSION_TIMEOUT_MS_DEFAULT))
    # ... and a producer's transaction.timeout.ms above transaction.max.timeout.ms.
    assert config.transaction_timeout_ms <= int(kafka["KAFKA_TRANSACTION_MAX_TIMEOUT_MS"])
    # One broker: a replication factor above 1 cannot create the WAL topic.
    assert config.wal_replication_factor in (0, 1)
    # Three nodes, every shard on each by default (RF=2 places each shard on two).
    assert config.replication_factor == 3


def test_cli_endpoints_in_the_containers_are_the_advertised_addresses() -> None:
    advertised = [environment(name)["KVSTORE_ADVERTISE"] for name in NODES]
    for name in NODES:
        assert environment(name).get(ENDPOINTS_ENV, "").split(",") == advertised


def test_nodes_start_after_a_healthy_kafka_and_report_their_own_health() -> None:
    for name in NODES:
        svc = service(name)
        assert svc["depends_on"][KAFKA]["condition"] == "service_healthy"
        test = svc["healthcheck"]["test"]
        assert "grpc_health" in " ".join(test if isinstance(test, list) else [test])
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure")


# ---- the snapshot job --------------------------------------------------------------------------


def snapshot_command() -> argparse.Namespace:
    command = service(SNAPSHOT).get("command")
    assert isinstance(command, list), "exec form (a list): no shell between compose and kvstore"
    return cli_args([str(token) for token in command])


def test_snapshot_service_is_a_one_shot_job_in_the_pipeline_profile() -> None:
    svc = service(SNAPSHOT)
    assert svc.get("profiles") == [PIPELINE_PROFILE], "`docker compose up` must not start it"
    assert svc.get("restart") == "no", "one-shot (and quoted: a bare no is a YAML boolean)"
    assert svc["depends_on"][KAFKA]["condition"] == "service_healthy"
    assert not svc.get("ports"), "a batch job serves nothing"
    assert "healthcheck" not in svc


def test_snapshot_service_runs_the_nodes_image() -> None:
    """The same code and WAL schema as the nodes, and nothing pulled from a registry under that name."""
    svc = service(SNAPSHOT)
    assert svc.get("image") == node_image()
    assert "build" not in svc
    assert svc.get("pull_policy") == "never"


def test_snapshot_service_creates_a_snapshot_where_the_nodes_load_them(monkeypatch: pytest.MonkeyPatch) -> None:
    args = snapshot_command()
    assert (args.command, args.snapshot_action) == ("snapshot", "create")
    assert args.dir == snapshot_dir(monkeypatch), "--dir is the nodes' KVSTORE_SNAPSHOT_DIR"
    assert named_volume_mounts(SNAPSHOT).get(args.dir) == snapshot_volume(monkeypatch), \
        f"{args.dir} in the job is not the volume the nodes have there"


def test_snapshot_service_reads_the_compose_broker_and_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    args = snapshot_command()
    config = node_config(NODES[0], monkeypatch)
    assert args.kafka == kafka_internal_address() == config.kafka
    assert args.cluster == config.cluster and args.topic in (None, config.wal_topic)
    env = environment(SNAPSHOT)
    # What commands run by hand in the service (audit, wal truncate) take as --kafka's default...
    assert env.get("KVSTORE_KAFKA", args.kafka) == args.kafka
    # ... and where they ask for the WAL topic: the nodes' advertised addresses.
    advertised = [environment(name)["KVSTORE_ADVERTISE"] for name in NODES]
    assert env.get(ENDPOINTS_ENV, ",".join(advertised)).split(",") == advertised


def test_snapshot_service_kvstore_variables_are_read_by_the_pipeline() -> None:
    """A typo in a KVSTORE_* name would silently keep the default; these are the names the CLI and
    the pipeline's code actually read."""
    unknown = {key for key in environment(SNAPSHOT) if key.startswith("KVSTORE_")} - pipeline_variables()
    assert not unknown, f"{SNAPSHOT}: variables nothing reads: {sorted(unknown)}"


def test_documented_pipeline_commands_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The `docker compose run --rm snapshot kvstore ...` lines in the compose file's comments are
    commands kvstore accepts, on the snapshot volume."""
    prefix = f"docker compose run --rm {SNAPSHOT} "
    documented = [line.split("#", 1)[1].strip() for line in COMPOSE.read_text().splitlines()
                  if line.lstrip().startswith("#") and prefix + "kvstore" in line]
    assert documented, "document how to run the other pipeline commands (audit, wal truncate) in the service"
    parsed = [cli_args(shlex.split(line[len(prefix):])) for line in documented]
    assert {"audit", "wal-truncate"} <= {args.pipeline for args in parsed}, documented
    for line, args in zip(documented, parsed, strict=True):
        assert args.dir == snapshot_dir(monkeypatch), line


# ---- the image -------------------------------------------------------------------------------


def test_image_is_python_slim_on_one_base_for_every_stage() -> None:
    bases = {rest.split()[0] for keyword, rest in dockerfile() if keyword == "FROM"}
    assert len(bases) == 1, f"the virtualenv is copied between stages: one base image, not {bases}"
    match = re.fullmatch(r"python:(\d+)\.(\d+)-slim(-\w+)?", bases.pop())
    assert match, "python:3.X-slim[-debian]"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = re.fullmatch(r">=\s*(\d+)\.(\d+)", requires)
    assert minimum and (int(match[1]), int(match[2])) >= (int(minimum[1]), int(minimum[2]))


def test_image_runs_the_node() -> None:
    commands = {keyword: json.loads(rest) for keyword, rest in final_stage() if keyword in ("ENTRYPOINT", "CMD")}
    argv = commands.get("ENTRYPOINT", []) + commands.get("CMD", [])  # exec form only: JSON arrays
    assert argv in (["kvstore", "serve"], ["python", "-m", "kvstore.server"]), argv
    assert image_env().get("KVSTORE_LISTEN", "").startswith("0.0.0.0:"), "reachable from outside the container"


def test_image_generates_the_stubs_by_the_package_build_like_make_proto() -> None:
    """One way to generate stubs everywhere: the package's build (setup.py), which `make proto`
    runs too. The image installs the project with pip's isolated build (the pinned grpcio-tools of
    [build-system]) from a context holding setup.py and proto/, and never runs protoc itself."""
    runs = [rest for keyword, rest in dockerfile() if keyword == "RUN"]
    assert not [run for run in runs if "grpc_tools.protoc" in run], "no second way of generating stubs"
    makefile = (ROOT / "Makefile").read_text()
    assert "setup.py stubs" in makefile and "grpc_tools.protoc" not in makefile
    install = [run for run in runs if re.search(r"pip install (?:--?\S+ )*'?\.(?:\[[\w,]+\])?'?(?:\s|$)", run)]
    assert len(install) == 1 and "--no-build-isolation" not in install[0], install
    copied = [rest.split() for keyword, rest in dockerfile() if keyword == "COPY" and not rest.startswith("--from")]
    sources = {source.rstrip("/") for args in copied for source in args[:-1]}
    assert {"proto", "setup.py", "MANIFEST.in", "pyproject.toml"} <= sources, sources


def test_build_context_has_what_the_image_copies_and_no_local_stubs() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for stub in ("**/*_pb2.py", "**/*_pb2.pyi", "**/*_pb2_grpc.py"):
        assert stub in patterns, f".dockerignore must exclude {stub}: the image generates its own"
    if "*" in patterns:  # an allowlist: every COPY source must be let back in (itself or a parent)
        allowed = {PurePosixPath(p[1:].rstrip("/")) for p in patterns if p.startswith("!")}
        for keyword, rest in dockerfile():
            if keyword == "COPY" and not rest.startswith("--"):
                *sources, _ = rest.split()
                for source in sources:
                    path = PurePosixPath(source.rstrip("/"))
                    assert any(path == a or path.is_relative_to(a) for a in allowed), \
                        f"COPY {source} is excluded by .dockerignore"


# ---- the image: the Spark pipeline -------------------------------------------------------------


def java_release() -> int:
    """The bytecode level kvstore/pipeline/jars.py compiles the WAL decoders for (javac --release)."""
    match = re.search(r'"--release",\s*"(\d+)"', (ROOT / "kvstore" / "pipeline" / "jars.py").read_text())
    assert match, "jars.py passes javac --release N"
    return int(match[1])


def openjdk_majors(packages: set[str], kind: str) -> set[int]:
    return {int(m[1]) for p in packages if (m := re.fullmatch(rf"openjdk-(\d+)-{kind}(-headless)?", p))}


def test_image_build_stage_builds_the_pipeline_jars_from_the_installed_package() -> None:
    stage = build_stages()
    packages = apt_packages(stage)
    assert "maven" in packages, "jars.py resolves the Kafka connector with mvn"
    assert any(major >= java_release() for major in openjdk_majors(packages, "jdk")), \
        f"a JDK >= {java_release()} for javac --release {java_release()}"
    runs = [rest for keyword, rest in stage if keyword == "RUN"]
    commands = [command.strip() for run in runs for command in run.split("&&")]
    fetch = [i for i, command in enumerate(commands) if re.search(r"-m kvstore\.pipeline\.jars fetch\b", command)]
    install = [i for i, command in enumerate(commands) if re.search(r"pip install (?:--?\S+ )*\.$", command)]
    assert fetch and install, "the build stage runs `pip install .`, then `python -m kvstore.pipeline.jars fetch`"
    # After the install (which brings the stubs it hashes and pyspark's jars it compiles against) ...
    assert fetch[0] > install[0], "jars fetch after pip install ."
    # ... and by the installed package, not the source tree in the WORKDIR (`-m` puts the current
    # directory first on sys.path): so a file missing from the package data fails the build here.
    command = next(run for run in runs if commands[fetch[0]] in run)
    workdir = [rest for keyword, rest in stage if keyword == "WORKDIR"][-1]
    cd = re.match(r"cd (\S+) &&", command)
    assert " -P " in command or (cd and cd[1].rstrip("/") != workdir.rstrip("/")), command
    assert stage_env(stage).get("KVSTORE_SPARK_HOME") or "KVSTORE_SPARK_HOME=" in command, "a fixed directory"


def test_image_final_stage_has_a_java_runtime_and_the_built_jars() -> None:
    stage = final_stage()
    packages = apt_packages(stage)
    assert any(major >= java_release() for major in openjdk_majors(packages, "jre")), \
        f"a Java runtime >= {java_release()} (Spark 4 and the decoders need it)"
    assert "maven" not in packages and not openjdk_majors(packages, "jdk"), "build tools stay in the build stage"
    spark_home = image_env().get("KVSTORE_SPARK_HOME")
    assert spark_home, "KVSTORE_SPARK_HOME: where the session finds the jars (else ~/.cache, empty)"
    built_home = stage_env(build_stages()).get("KVSTORE_SPARK_HOME")
    copies = [rest.split()[1:] for keyword, rest in stage if keyword == "COPY" and rest.startswith("--from=")]
    assert [built_home, spark_home] in [[s.rstrip("/") for s in c] for c in copies], \
        f"COPY --from=build {built_home} {spark_home}"
    checks = " && ".join(rest for keyword, rest in stage if keyword == "RUN")
    for check in ("kvstore.pipeline.session", "kvstore snapshot --help", "kvstore.pipeline.jars path"):
        assert check in checks, f"the build-time smoke check covers {check!r}"


def test_image_dirs_for_named_volumes_belong_to_the_service_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """Docker fills a fresh named volume from the image's directory, owner included: a directory
    the image lacks or root owns would be a volume the node (or the snapshot job) cannot write."""
    stage = final_stage()
    user = [rest for keyword, rest in stage if keyword == "USER"][-1]
    assert user not in ("root", "0"), "runs unprivileged"
    owned: set[str] = set()
    for keyword, rest in stage:
        if keyword == "RUN":
            for owner, paths in re.findall(r"chown (?:-\S+ )*(\S+) ([^&;|]+)", rest):
                if owner.split(":")[0] == user:
                    owned.update(paths.split())
    config = node_config(NODES[0], monkeypatch)
    for path in (str(config.data_dir), snapshot_dir(monkeypatch)):
        assert path in owned, f"{path} is not chowned to {user} in the image"


def test_installed_package_carries_the_pipeline_jvm_sources() -> None:
    """The image installs the project non-editable, and jars.py reads its pom and Java sources
    next to itself: every one of them must be package data (setuptools globs, per package)."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvstore"]
    shipped = {path for pattern in patterns for path in (ROOT / "kvstore").glob(pattern)}
    jvm = ROOT / "kvstore" / "pipeline" / "jvm"
    needed = {jvm / "pom.xml", *(jvm / "src").rglob("*.java")}
    assert len(needed) > 1 and needed <= shipped, f"not package data: {sorted(map(str, needed - shipped))}"
