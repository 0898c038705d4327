"""The node's configuration (kvstore.server.config): one definition per setting, read from flags
over KVSTORE_* variables over a TOML file over the defaults; anything unknown refused by name."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.server import config
from kvstore.server.config import ConfigError, NodeConfig, unknown_variables

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.upper().startswith("KVSTORE_")]:
        monkeypatch.delenv(name)


def parse(*argv: str) -> NodeConfig:
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    return config.from_args(parser.parse_args(list(argv)))


def test_flags_over_environment_over_file_over_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('shards = 8\ncluster = "from-file"\nnode_id = "file-node"\nsession_timeout_ms = 3000\n')
    monkeypatch.setenv("KVSTORE_CLUSTER", "from-env")
    monkeypatch.setenv("KVSTORE_NODE_ID", "env-node")
    loaded = parse("--config", str(toml), "--node-id", "flag-node", "--follower", "--no-standby")
    assert loaded.node_id == "flag-node"  # flag over env over file
    assert loaded.cluster == "from-env"  # env over file
    assert loaded.shards == 8 and loaded.session_timeout_ms == 3000  # file over default
    assert loaded.listen == "127.0.0.1:50051"  # default
    assert loaded.lead is False and loaded.standby is False
    monkeypatch.setenv("KVSTORE_CONFIG", str(toml))  # the file from the environment
    assert parse().shards == 8


def test_every_setting_has_one_flag_an_env_name_and_help() -> None:
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    for name, flag, env, description in config.describe():
        assert description and env == f"KVSTORE_{name.upper()}"
        if name == "kafka_password":
            assert flag == ""  # never on a command line
        else:
            assert flag in flags, name


@pytest.mark.parametrize(("environ", "refused"), [
    ({"KVSTORE_SHRADS": "4"}, "KVSTORE_SHRADS (did you mean KVSTORE_SHARDS?)"),
    ({"kvstore_shrads": "4"}, "kvstore_shrads"),
    ({"KVSTORE_WHATEVER": "1"}, "KVSTORE_WHATEVER"),
])
def test_an_unknown_variable_is_refused_with_the_closest_name(environ: dict[str, str], refused: str) -> None:
    problems = unknown_variables(environ)
    assert len(problems) == 1 and refused in problems[0], problems


def test_variables_of_other_parts_are_known() -> None:
    environ = {"KVSTORE_ENDPOINTS": "a:1", "KVSTORE_TOKEN": "t", "KVSTORE_CA": "ca.pem", "KVSTORE_SHARDS": "4",
               "KVSTORE_KAFKA_HOME": "/opt", "KVSTORE_CONFIG": "node.toml", "OTHER": "x"}
    assert unknown_variables(environ) == []


def test_the_node_refuses_to_start_on_an_unknown_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_SHRADS", "8")
    with pytest.raises(ConfigError, match="did you mean KVSTORE_SHARDS"):
        parse()
    done = subprocess.run([sys.executable, "-m", "kvstore.server"], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert done.returncode == 2 and "KVSTORE_SHRADS" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--shards", "0"], {}, "shards (flag --shards): Input should be greater than or equal to 1 (got '0')"),
    (["--shards", "1025"], {}, "shards (flag --shards): Input should be less than or equal to 1024"),
    (["--shards", "x"], {}, "shards (flag --shards): Input should be a valid integer"),
    ([], {"KVSTORE_SESSION_TIMEOUT_MS": "10"}, "session_timeout_ms (env KVSTORE_SESSION_TIMEOUT_MS): Input should "
                                                "be greater than or equal to 1000"),
    ([], {"KVSTORE_LEAD": "maybe"}, "lead (env KVSTORE_LEAD): Input should be a valid boolean"),
    (["--cluster", "a.b"], {}, "cluster (flag --cluster): must be non-empty and contain no dot (got 'a.b')"),
    (["--node-id", "a@b"], {}, "node_id (flag --node-id): must be 1..200 bytes and contain no '@'"),
    (["--node-id", "n" * 201], {}, "node_id (flag --node-id): must be 1..200 bytes and contain no '@'"),
    ([], {"KVSTORE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"}, "Kafka login"),
])
def test_invalid_values_name_the_setting_and_where_it_came_from(
        monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], message: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="invalid configuration") as info:
        parse(*argv)
    assert message in str(info.value), str(info.value)


def test_a_file_with_an_unknown_key_or_bad_toml_is_refused(tmp_path: Path) -> None:
    bad_key = tmp_path / "a.toml"
    bad_key.write_text('node_idd = "x"\n')
    with pytest.raises(ConfigError, match=r"unknown settings node_idd \(did you mean node_id\?\)"):
        parse("--config", str(bad_key))
    not_toml = tmp_path / "b.toml"
    not_toml.write_text("shards = = 4\n")
    with pytest.raises(ConfigError, match="is not TOML"):
        parse("--config", str(not_toml))
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        parse("--config", str(tmp_path / "missing.toml"))
    wrong_type = tmp_path / "c.toml"
    wrong_type.write_text('shards = "many"\n')
    with pytest.raises(ConfigError, match=f"shards \\(file {wrong_type}\\)"):
        parse("--config", str(wrong_type))


def test_the_kafka_password_never_shows_and_comes_from_env_or_a_file(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("from-file\n")
    monkeypatch.setenv("KVSTORE_KAFKA_USERNAME", "store")
    monkeypatch.setenv("KVSTORE_KAFKA_PASSWORD", "from-env")
    loaded = parse()
    assert loaded.kafka_password == "from-env" and "from-env" not in repr(loaded)
    assert parse("--kafka-password-file", str(secret)).kafka_password == "from-file"  # the flag's file wins
