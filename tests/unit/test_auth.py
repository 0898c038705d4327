"""gRPC security without Kafka: the role table, the token file, identities, the node's settings
(`kvstore.server.auth`), the development CA (`kvstore.dev.ca`), the client's settings
(`kvstore.client.security`), and the one interceptor refusing calls over real TLS in-process."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from kvstore import errors
from kvstore.client import PermissionDenied, Unauthenticated
from kvstore.client.errors import InvalidArgument, error_from_rpc
from kvstore.client.security import ClientSecurity
from kvstore.dev.ca import DevCA, DevPki
from kvstore.internal.v1 import peer_pb2
from kvstore.server import auth
from kvstore.server.auth import Authorizer, Identity, Role
from kvstore.server.interceptor import ErrorInterceptor
from kvstore.server.metrics import Metrics
from kvstore.v1 import cluster_pb2, kv_pb2
from wal.broker import free_port

REPO = Path(__file__).resolve().parents[2]
R, W, A, N = Role.READ, Role.WRITE, Role.ADMIN, Role.NODE

# -- the role table ---------------------------------------------------------------------------

ACCESS = [
    ("/kvstore.v1.KVService/Get", R), ("/kvstore.v1.KVService/Scan", R), ("/kvstore.v1.KVService/Watch", R),
    ("/kvstore.v1.KVService/Put", W), ("/kvstore.v1.KVService/Delete", W), ("/kvstore.v1.KVService/Txn", W),
    ("/kvstore.v1.KVService/WriteBatch", W),
    ("/kvstore.v1.ClusterService/ShardMap", R), ("/kvstore.v1.ClusterService/ShardDigest", R),
    ("/kvstore.v1.ClusterService/ListTransactions", R), ("/kvstore.v1.ClusterService/FenceShard", A),
    ("/kvstore.internal.v1.PeerService/ScanShards", N), ("/kvstore.internal.v1.PeerService/LocalShardView", N),
    ("/kvstore.internal.v1.PeerService/CheckFenced", N), ("/kvstore.internal.v1.PeerService/Invented", N),
    ("/grpc.health.v1.Health/Check", None), ("/grpc.health.v1.Health/Watch", None),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", R),
    ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", R),
    ("/kvstore.v1.KVService/Invented", A), ("/some.Other/Thing", A), ("nonsense", A),  # fail closed
]


@pytest.mark.parametrize(("path", "role"), ACCESS)
def test_required_role(path: str, role: Role | None) -> None:
    assert auth.required_role(path) is role


def test_every_rpc_of_the_protos_is_placed_on_purpose() -> None:
    """A new RPC must get its line in the table (else it would need admin by default)."""
    services = [*kv_pb2.DESCRIPTOR.services_by_name.values(), *cluster_pb2.DESCRIPTOR.services_by_name.values(),
                *peer_pb2.DESCRIPTOR.services_by_name.values()]
    paths = [f"/{s.full_name}/{m.name}" for s in services for m in s.methods]
    assert len(paths) >= 14
    missing = [p for p in paths if p not in auth._METHODS]
    assert not missing, f"add these to kvstore.server.auth._METHODS (and docs/security.md): {missing}"


# role, required -> allowed
ALLOWS = {
    (R, R): True, (R, W): False, (R, A): False, (R, N): False,
    (W, R): True, (W, W): True, (W, A): False, (W, N): False,
    (A, R): True, (A, W): True, (A, A): True, (A, N): False,
    (N, R): True, (N, W): True, (N, A): False, (N, N): True,
}


@pytest.mark.parametrize(("role", "required"), list(ALLOWS))
def test_allows(role: Role, required: Role) -> None:
    assert auth.allows(role, required) is ALLOWS[(role, required)]


def test_decide() -> None:
    auth.decide("/kvstore.v1.KVService/Get", Identity("token:r", R))
    auth.decide("/grpc.health.v1.Health/Check", Identity("cert:x", None))  # open
    with pytest.raises(errors.PermissionDeniedError,
                       match=r"token:r \(role read\) may not call .*Put: it needs role write"):
        auth.decide("/kvstore.v1.KVService/Put", Identity("token:r", R))
    with pytest.raises(errors.PermissionDeniedError, match="carries no kvstore role"):
        auth.decide("/kvstore.v1.KVService/Get", Identity("cert:x", None))
    with pytest.raises(errors.PermissionDeniedError, match="needs role node"):
        auth.decide("/kvstore.internal.v1.PeerService/ScanShards", Identity("token:admin", A))


# -- tokens -----------------------------------------------------------------------------------


def test_token_file_round_trip() -> None:
    tokens = {role: auth.new_token() for role in Role}
    text = "# comment\n\n" + "\n".join(auth.token_line(t, role, f"who-{role.value}") + "  # trailing"
                                       for role, t in tokens.items()) + "\n"
    parsed = auth.parse_tokens(text)
    for role, token in tokens.items():
        assert parsed[auth.hash_token(token)] == Identity(f"token:who-{role.value}", role)
        assert token not in text  # the file holds hashes only
    upper = auth.parse_tokens(auth.token_line("t", W, "x").upper().replace("WRITE", "write"))
    assert upper[auth.hash_token("t")].role is W  # hex in capitals is the same hash


@pytest.mark.parametrize(("text", "message"), [
    ("abc write x", "not a SHA-256"),
    (f"{'a' * 64} write", "expected '<sha256 hex> <role> <name>', got 2 fields"),
    (f"{'a' * 64} root x", "unknown role 'root'"),
    (f"{'a' * 64} read x\n{'A' * 64} write y", "line 2: the same token is listed twice"),
    ("# nothing\n", "lists no token"),
    (f"{'g' * 64} read x", "not a SHA-256"),
])
def test_bad_token_files_are_refused_with_the_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        auth.parse_tokens(text)


@pytest.mark.parametrize(("metadata", "token"), [
    ((), None), ((("user-agent", "x"),), None), ((("authorization", "Bearer abc"),), "abc"),
    ((("Authorization", "bearer  abc "),), "abc"), ((("authorization", b"Bearer abc"),), "abc"),
])
def test_bearer_token(metadata: tuple[tuple[str, Any], ...], token: str | None) -> None:
    assert auth.bearer_token(metadata) == token


@pytest.mark.parametrize("metadata", [
    (("authorization", "Basic dXNlcjpwdw=="),), (("authorization", "Bearer"),), (("authorization", "abc"),),
    (("authorization", "Bearer a"), ("authorization", "Bearer b")),
])
def test_other_authorization_metadata_is_refused(metadata: tuple[tuple[str, str], ...]) -> None:
    with pytest.raises(errors.UnauthenticatedError):
        auth.bearer_token(metadata)


CERT_CONTEXT = {"transport_security_type": [b"ssl"], "x509_common_name": [b"dev-write"],
                "x509_subject": [b"CN=dev-write,O=kvstore development"],
                "x509_subject_alternative_name": [b"kvstore-role:write"], "peer_uri": [b"kvstore-role:write"]}


@pytest.mark.parametrize(("context", "identity"), [
    ({"transport_security_type": [b"ssl"]}, None),  # TLS without a client certificate
    (CERT_CONTEXT, Identity("cert:dev-write", W)),
    ({**CERT_CONTEXT, "peer_uri": [b"kvstore-role:node"], "x509_subject_alternative_name": [b"localhost"]},
     Identity("cert:dev-write", N)),
    ({**CERT_CONTEXT, "peer_uri": [b"spiffe://x/y"], "x509_subject_alternative_name": []},
     Identity("cert:dev-write", None)),
    ({**CERT_CONTEXT, "peer_uri": [b"kvstore-role:root"]}, Identity("cert:dev-write", None)),  # unknown + write
    ({**CERT_CONTEXT, "peer_uri": [b"kvstore-role:read", b"kvstore-role:admin"]}, Identity("cert:dev-write", None)),
    ({"x509_subject": [b"O=nameless"]}, Identity("cert:O=nameless", None)),
])
def test_certificate_identity(context: dict[str, list[bytes]], identity: Identity | None) -> None:
    assert auth.certificate_identity(context) == identity


def test_identify_prefers_a_token_and_never_falls_back_from_a_bad_one() -> None:
    tokens = auth.parse_tokens(auth.token_line("good", R, "reader"))
    both = Authorizer(tokens, certificates=True)
    bearer = (("authorization", "Bearer good"),)
    assert both.identify(bearer, CERT_CONTEXT) == Identity("token:reader", R)
    assert both.identify((), CERT_CONTEXT) == Identity("cert:dev-write", W)
    with pytest.raises(errors.UnauthenticatedError, match="not valid"):
        both.identify((("authorization", "Bearer bad"),), CERT_CONTEXT)
    only_tokens = Authorizer(tokens, certificates=False)
    with pytest.raises(errors.UnauthenticatedError, match="no credentials: this node needs an 'authorization"):
        only_tokens.identify((), CERT_CONTEXT)
    only_certs = Authorizer(None, certificates=True)
    assert only_certs.identify((("authorization", "Bearer whatever"),), CERT_CONTEXT).role is W  # tokens ignored
    with pytest.raises(errors.UnauthenticatedError, match="a client certificate"):
        only_certs.identify((), {})


# -- the node's settings and the development CA -------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return DevCA(tmp_path_factory.mktemp("pki") / "tls").ensure(["node-1", "node-2"])


def settings(**values: str) -> types.SimpleNamespace:
    fields = ("tls_cert", "tls_key", "tls_client_ca", "tokens_file", "node_token_file", "peer_ca", "auth")
    return types.SimpleNamespace(**{f: values.get(f, "") for f in fields})


def node_tls(pki: DevPki, node: str = "node-1") -> dict[str, str]:
    return {"tls_cert": str(pki.nodes[node].cert), "tls_key": str(pki.nodes[node].key)}


def test_the_dev_ca_writes_private_keys_and_tokens_and_reuses_them(pki: DevPki) -> None:
    from cryptography import x509

    secrets = [pki.directory / "ca.key", *(c.key for c in (*pki.nodes.values(), *pki.clients.values())),
               *pki.tokens.values()]
    for path in secrets:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    node = x509.load_pem_x509_certificate(pki.nodes["node-2"].cert.read_bytes())
    node.verify_directly_issued_by(ca)
    sans = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    assert auth.certificate_roles(pki.nodes["node-1"].cert.read_bytes()) == {"node"}
    assert auth.certificate_roles(pki.clients["admin"].cert.read_bytes()) == {"admin"}
    tokens = auth.parse_tokens(pki.tokens_file.read_text())
    for role, path in pki.tokens.items():
        assert tokens[auth.hash_token(path.read_text().strip())].role is Role(role)
    before = {p: p.read_bytes() for p in pki.directory.iterdir()}
    again = DevCA(pki.directory).ensure(["node-1", "node-2"])
    assert again == pki and {p: p.read_bytes() for p in pki.directory.iterdir()} == before


def test_plaintext_and_its_warning() -> None:
    security = auth.load(settings())
    assert security.mode == "plaintext" and security.credentials is None and security.authorizer is None
    warning = security.warning("127.0.0.1:50051")
    assert warning is not None and warning.startswith(
        "plaintext, no authentication: anyone who can reach 127.0.0.1:50051 can read and write")


def test_secure_settings(pki: DevPki) -> None:
    tokens = auth.load(settings(**node_tls(pki), tokens_file=str(pki.tokens_file),
                                node_token_file=str(pki.tokens["node"]), peer_ca=str(pki.ca)))
    assert tokens.mode == "tls + tokens" and tokens.authorizer is not None and tokens.warning("x") is None
    assert tokens.credentials is not None and tokens.peer_credentials is not None
    mutual = auth.load(settings(**node_tls(pki), tls_client_ca=str(pki.ca)))
    assert mutual.mode == "mutual tls" and mutual.authorizer is not None
    both = auth.load(settings(**node_tls(pki), tls_client_ca=str(pki.ca), tokens_file=str(pki.tokens_file)))
    assert both.mode == "mutual tls + tokens"
    write = pki.clients["write"]  # no role node in it: with tokens on both sides the node token vouches instead
    assert auth.load(settings(tls_cert=str(write.cert), tls_key=str(write.key), tls_client_ca=str(pki.ca),
                              tokens_file=str(pki.tokens_file), node_token_file=str(pki.tokens["node"]))).authorizer
    none = auth.load(settings(**node_tls(pki), auth="none", peer_ca=str(pki.ca)))
    assert none.authorizer is None and "TLS without authentication (--auth none): anyone who can reach x" in str(
        none.warning("x"))


@pytest.mark.parametrize(("values", "message"), [
    ({"tokens_file": "t"}, "--tokens-file need TLS"),
    ({"tls_client_ca": "c", "peer_ca": "p"}, "--tls-client-ca, --peer-ca need TLS"),
    ({"tls_cert": "c"}, "--tls-cert and --tls-key go together"),
    ({"auth": "maybe"}, "--auth must be"),
    ({"tls": "node-1"}, "authenticates nobody: give one of them, or --auth none"),
    ({"tls": "node-1", "auth": "none", "tokens": "yes"}, "--auth none contradicts"),
    ({"tls": "node-1", "tokens": "yes"}, "give --node-token-file"),
    ({"tls": "node-1", "tokens": "yes", "node_token": "write"}, "must be in --tokens-file with role node"),
    ({"tls": "write", "client_ca": "yes"}, "has no URI SAN kvstore-role:node"),
    ({"tls": "write", "client_ca": "yes", "node_token": "node"}, "has no URI SAN kvstore-role:node"),
    ({"tls": "node-1", "tokens_file": "/nonexistent/tokens", "node_token": "node"}, "No such file"),
    ({"tls": "node-1", "client_ca": "tokens"}, "is not PEM"),
])
def test_contradictions_and_unusable_files_refuse_to_start(pki: DevPki, values: dict[str, str], message: str) -> None:
    given = dict(values)
    if "tls" in given:
        name = given.pop("tls")
        cred = pki.nodes[name] if name in pki.nodes else pki.clients[name]
        given |= {"tls_cert": str(cred.cert), "tls_key": str(cred.key)}
    if given.pop("tokens", None):
        given["tokens_file"] = str(pki.tokens_file)
    if "node_token" in given:
        given["node_token_file"] = str(pki.tokens[given.pop("node_token")])
    if (ca := given.pop("client_ca", None)) is not None:
        given["tls_client_ca"] = str(pki.tokens_file) if ca == "tokens" else str(pki.ca)
    with pytest.raises(ValueError, match=message):
        auth.load(settings(**given))


def test_a_node_refuses_to_start_with_tls_but_no_authentication(pki: DevPki, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.server", "--kafka", "127.0.0.1:1", "--listen", f"127.0.0.1:{free_port()}",
         "--data-dir", str(tmp_path / "data"), "--cluster", "tls", "--tls-cert", str(pki.nodes["node-1"].cert),
         "--tls-key", str(pki.nodes["node-1"].key)],
        capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert "authenticates nobody" in proc.stderr and "--auth none" in proc.stderr


def test_a_plaintext_node_warns_loudly_at_startup(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.server", "--kafka", "127.0.0.1:1", "--listen", f"127.0.0.1:{port}",
         "--data-dir", str(tmp_path / "data"), "--cluster", "plain"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    guard = threading.Timer(60, proc.kill)  # a node that never says it ends the read, not the test run
    guard.start()
    try:
        assert proc.stderr is not None
        warning = next((line for line in proc.stderr if '"event": "insecure"' in line), "")
    finally:
        guard.cancel()
        proc.kill()
        proc.wait(10)
    assert f"WARNING: plaintext, no authentication: anyone who can reach 127.0.0.1:{port} can read and write" \
        in warning and '"level": "warning"' in warning, warning


# -- the client's settings --------------------------------------------------------------------


def test_client_security_from_flags_and_environment(pki: DevPki) -> None:
    assert not ClientSecurity.from_env({}).tls and ClientSecurity.from_env({}).credentials() is None
    env = {"KVSTORE_CA": str(pki.ca), "KVSTORE_TOKEN_FILE": str(pki.tokens["read"])}
    read = ClientSecurity.from_env(env)
    assert read.tls and read.ca == str(pki.ca) and read.token == pki.tokens["read"].read_text().strip()
    assert read.token not in repr(read)  # never printed
    assert ClientSecurity.from_env(env, token="flag").token == "flag"  # a flag over the environment
    assert ClientSecurity.from_env({**env, "KVSTORE_TOKEN": "envtoken"}).token == "envtoken"
    assert ClientSecurity.from_env(env, token_file=str(pki.tokens["admin"])).token == \
        pki.tokens["admin"].read_text().strip()
    cert = ClientSecurity.from_env({"KVSTORE_CERT": "c.pem", "KVSTORE_KEY": "c.key"})
    assert cert.tls and cert.describe() == "tls + client certificate"
    with pytest.raises(InvalidArgument, match="needs its key"):
        ClientSecurity.from_env({"KVSTORE_CERT": "c.pem"})
    with pytest.raises(InvalidArgument, match="token file /nonexistent"):
        ClientSecurity.from_env({}, token_file="/nonexistent")
    with pytest.raises(InvalidArgument, match="CA file /nonexistent"):
        ClientSecurity(ca="/nonexistent").credentials()


# -- the interceptor over real TLS, in-process --------------------------------------------------


def _answer(response: Any) -> Any:
    async def behavior(request: Any, context: Any) -> Any:
        return response
    return behavior


class SecureServer:
    """A grpc.aio server on its own loop and thread: the one interceptor with an authorizer, a
    health service and two stand-in KV methods, on a TLS port."""

    def __init__(self, security: auth.ServerSecurity) -> None:
        self.security = security
        self.metrics = Metrics()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> SecureServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        server = grpc.aio.server(interceptors=[ErrorInterceptor(self.metrics, authorize=self.security.authorizer)])
        handlers = {
            "Get": grpc.unary_unary_rpc_method_handler(_answer(kv_pb2.GetResponse(found=True)),
                                                       request_deserializer=kv_pb2.GetRequest.FromString,
                                                       response_serializer=kv_pb2.GetResponse.SerializeToString),
            "Put": grpc.unary_unary_rpc_method_handler(_answer(kv_pb2.PutResponse()),
                                                       request_deserializer=kv_pb2.PutRequest.FromString,
                                                       response_serializer=kv_pb2.PutResponse.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvstore.v1.KVService", handlers),))
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        assert self.security.credentials is not None
        self.port = server.add_secure_port("127.0.0.1:0", self.security.credentials)
        await server.start()
        self._server = server

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def token_server(pki: DevPki) -> Iterator[SecureServer]:
    security = auth.load(settings(**node_tls(pki), tokens_file=str(pki.tokens_file),
                                  node_token_file=str(pki.tokens["node"]), peer_ca=str(pki.ca)))
    with SecureServer(security) as server:
        yield server


def _get(channel: grpc.Channel) -> Any:
    return channel.unary_unary("/kvstore.v1.KVService/Get", request_serializer=kv_pb2.GetRequest.SerializeToString,
                               response_deserializer=kv_pb2.GetResponse.FromString)(kv_pb2.GetRequest(key=b"k"),
                                                                                   timeout=5)


def _put(channel: grpc.Channel) -> Any:
    return channel.unary_unary("/kvstore.v1.KVService/Put", request_serializer=kv_pb2.PutRequest.SerializeToString,
                               response_deserializer=kv_pb2.PutResponse.FromString)(
        kv_pb2.PutRequest(key=b"k", value=b"v"), timeout=5)


def _reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, error
    info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(info) for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR))
    assert info.metadata["outcome"] == "none"
    return info.reason


def test_tokens_over_tls_in_process(token_server: SecureServer, pki: DevPki) -> None:
    address = token_server.address
    with grpc.insecure_channel(address) as plain, pytest.raises(grpc.RpcError) as refused:
        _get(plain)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS port does not speak plaintext
    with ClientSecurity(ca=str(pki.ca)).channel(address) as anonymous:
        reply = health_pb2_grpc.HealthStub(anonymous).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # health is open to probes
        with pytest.raises(grpc.RpcError) as none:
            _get(anonymous)
        assert none.value.code() == grpc.StatusCode.UNAUTHENTICATED and _reason(none.value) == "UNAUTHENTICATED"
        assert isinstance(error_from_rpc(none.value, write=True), Unauthenticated)  # definite: outcome none
    with ClientSecurity(ca=str(pki.ca), token="forged").channel(address) as forged, \
            pytest.raises(grpc.RpcError) as bad:
        _get(forged)
    assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED and "not valid" in str(bad.value.details())
    read = ClientSecurity.from_env({}, ca=str(pki.ca), token_file=str(pki.tokens["read"]))
    with read.channel(address) as reader:
        assert _get(reader).found
        with pytest.raises(grpc.RpcError) as denied:
            _put(reader)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED and _reason(denied.value) == "PERMISSION_DENIED"
        assert "token:dev-read (role read) may not call /kvstore.v1.KVService/Put" in str(denied.value.details())
        assert isinstance(error_from_rpc(denied.value, write=True), PermissionDenied)
    with ClientSecurity(ca=str(pki.ca), token=pki.tokens["write"].read_text().strip()).channel(address) as writer:
        assert _put(writer) is not None
    counted = token_server.metrics.registry.get_sample_value(
        "kvstore_requests_total", {"method": "Put", "code": "PERMISSION_DENIED", "reason": "PERMISSION_DENIED"})
    assert counted == 1
    # Every unary call is timed too, refusals included, by method and code (the dashboard's latency panels).
    registry = token_server.metrics.registry
    timed = registry.get_sample_value("kvstore_request_duration_seconds_count",
                                      {"method": "Put", "code": "PERMISSION_DENIED"})
    assert timed == 1
    ok_puts = registry.get_sample_value("kvstore_request_duration_seconds_count", {"method": "Put", "code": "OK"})
    took_s = registry.get_sample_value("kvstore_request_duration_seconds_sum", {"method": "Put", "code": "OK"})
    assert ok_puts == 1 and took_s is not None and 0 < took_s < 5


def test_mutual_tls_in_process(pki: DevPki) -> None:
    with SecureServer(auth.load(settings(**node_tls(pki), tls_client_ca=str(pki.ca)))) as server:
        with ClientSecurity(ca=str(pki.ca), token="ignored").channel(server.address) as no_cert, \
                pytest.raises(grpc.RpcError) as handshake:
            _get(no_cert)
        assert handshake.value.code() == grpc.StatusCode.UNAVAILABLE  # no certificate, no connection
        read, write = pki.clients["read"], pki.clients["write"]
        with ClientSecurity(ca=str(pki.ca), cert=str(read.cert), key=str(read.key)).channel(server.address) as reader:
            assert _get(reader).found
            with pytest.raises(grpc.RpcError) as denied:
                _put(reader)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "cert:dev-read (role read)" in str(denied.value.details())
        with ClientSecurity(ca=str(pki.ca), cert=str(write.cert), key=str(write.key)).channel(server.address) as w:
            assert _put(w) is not None
