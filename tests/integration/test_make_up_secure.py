"""`make up-secure` (`python -m kvstore.dev.cluster --secure`): the dev cluster with gRPC TLS and
tokens from its development CA, and Kafka with SASL/SCRAM and ACLs. It refuses plaintext and
unauthenticated calls; the exports it prints are what a shell needs to work with it."""

from __future__ import annotations

import json
import queue
import subprocess
from pathlib import Path

import grpc
import pytest
from confluent_kafka import KafkaError, Producer

from kvstore.v1 import kv_pb2, kv_pb2_grpc
from tests.integration.secure_cluster import kvstore
from tests.integration.test_make_up import DevCluster

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def printed_until(cluster: DevCluster, marker: str, timeout_s: float = 30) -> str:
    lines: list[str] = []
    while not any(marker in line for line in lines):
        try:
            lines.append(cluster.lines.get(timeout=timeout_s))
        except queue.Empty:
            break
    return "".join(lines)


def test_make_up_secure_refuses_plaintext_and_unauthenticated_calls(tmp_path: Path) -> None:
    data = tmp_path / "data"
    cluster = DevCluster(data, ("--secure", "--nodes", "2"))
    try:
        info = cluster.wait_endpoints()
        assert info["grpc_security"] == "tls+tokens" and info["kafka_username"] == "dev-pipeline", info
        addresses: list[str] = info["endpoints"]  # type: ignore[assignment]
        endpoints = ",".join(addresses)
        tls = data / "tls"
        printed = printed_until(cluster, "Ctrl-C stops everything")
        assert f"export KVSTORE_CA={tls / 'ca.pem'} KVSTORE_TOKEN_FILE={tls / 'write.token'}" in printed, printed
        assert f"grpcurl -cacert {tls / 'ca.pem'} -H \"authorization: Bearer $(cat {tls / 'read.token'})\"" in printed
        assert "WARNING: plaintext" not in printed

        with grpc.insecure_channel(addresses[0]) as channel, pytest.raises(grpc.RpcError) as plain:
            kv_pb2_grpc.KVServiceStub(channel).Get(kv_pb2.GetRequest(key=b"k"), timeout=5)  # type: ignore[no-untyped-call]
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
        base = ["--endpoints", endpoints, "--timeout", "10"]
        anonymous = kvstore({"KVSTORE_CA": str(tls / "ca.pem")}, *base, "get", "k")
        assert anonymous.returncode == 1 and anonymous.stderr.startswith("kvstore: unauthenticated"), anonymous.stderr
        write_env = {"KVSTORE_CA": str(tls / "ca.pem"), "KVSTORE_TOKEN_FILE": str(tls / "write.token")}
        read_env = {"KVSTORE_CA": str(tls / "ca.pem"), "KVSTORE_TOKEN_FILE": str(tls / "read.token")}
        put = kvstore(write_env, *base, "put", "k", "secure")
        assert put.returncode == 0, put.stderr
        got = kvstore(read_env, *base, "get", "k", "--output", "json")
        assert got.returncode == 0 and json.loads(got.stdout)["value"] == "secure", got.stderr
        denied = kvstore(read_env, *base, "put", "k", "nope")
        assert denied.returncode == 1 and denied.stderr.startswith("kvstore: permission denied"), denied.stderr
        fence = kvstore({**write_env, "KVSTORE_TOKEN_FILE": str(tls / "admin.token")}, *base, "fence", "0")
        assert fence.returncode == 0, fence.stderr
        # The failover demo's own clients and digest calls take the same settings from the environment.
        demo = kvstore(write_env, "--endpoints", endpoints, "demo", "failover", "--data-dir", str(data), "--output",
                       "json", "--warmup", "1", "--after", "2")
        assert demo.returncode == 0, demo.stderr
        result = json.loads(demo.stdout.splitlines()[-1])
        assert result["ok"] and result["acked"] > 0 and result["replicas_equal"] is True, result
        # Kafka refuses a client without the store's credentials: none at all (the broker drops
        # an unauthenticated connection, so the record never lands), or the pipeline's login
        # (it may read the WAL, never write it).
        kafka = str(info["kafka"])
        anonymous_producer = Producer({"bootstrap.servers": kafka, "message.timeout.ms": 3000})
        pipeline_producer = Producer({"bootstrap.servers": kafka, "message.timeout.ms": 5000,
                                      "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
                                      "sasl.username": str(info["kafka_username"]),
                                      "sasl.password": Path(str(info["kafka_password_file"])).read_text().strip()})
        for producer, expected in ((anonymous_producer, None), (pipeline_producer, "TOPIC_AUTHORIZATION_FAILED")):
            outcome: list[KafkaError | None] = []
            producer.produce("dev.wal", b"forged", partition=0,
                             on_delivery=lambda err, _msg, seen=outcome: seen.append(err))
            producer.flush(15)
            assert len(outcome) == 1 and outcome[0] is not None, outcome  # not written
            if expected:
                assert outcome[0].name() == expected, outcome[0]
        assert cluster.interrupt() == 0
    except BaseException:
        cluster.report(data)
        raise
    finally:
        cluster.cleanup()
    leftovers = subprocess.run(["pgrep", "-f", str(data)], capture_output=True, text=True, check=False).stdout
    assert leftovers.strip() == "", "processes of the dev cluster survived Ctrl-C"
