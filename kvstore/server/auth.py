"""gRPC security of a node: TLS on its port, who is calling, and whether the caller may make the call.

Modes (docs/security.md), fixed at startup from the node's settings (`load`):

* **plaintext** (no --tls-cert): no encryption, no authentication. Every call is served; the node
  logs a loud warning. For local development only.
* **TLS, no authentication** (--tls-cert/--tls-key and an explicit --auth none): encrypted, but
  anyone who reaches the port may read and write; also warned about.
* **TLS + bearer tokens** (--tokens-file): a caller sends `authorization: Bearer <token>`; the
  file maps the SHA-256 of each token to a role and a name (`parse_tokens`).
* **mutual TLS** (--tls-client-ca): every connection must present a certificate signed by that CA
  (gRPC Python cannot ask for a certificate without requiring it); the certificate's role is a
  URI subject alternative name `kvstore-role:<role>`, its name the subject's common name. With a
  tokens file as well, a bearer token (when sent) decides instead of the certificate.

Roles: `read` < `write` < `admin` for clients, and `node` for the nodes themselves (the peer
service, and a client's write or leader read that a node forwards to the shard's leader: the
first node authorized the client, the leader authorizes the node). `required_role` is the table,
`allows` the order; both pure. `Authorizer` applies them to a call; the one server interceptor
(`kvstore.server.interceptor`) calls it before decoding a request, so a refusal is an ordinary
`StoreError` (UNAUTHENTICATED or PERMISSION_DENIED, outcome none) with the same rich status and
metrics as any other. Health is open (probes carry no credentials; it says only SERVING or not);
reflection needs `read`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import secrets
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

from kvstore import errors

log = logging.getLogger("kvstore.server.auth")

ROLE_URI_PREFIX = "kvstore-role:"  # a certificate's role: URI SAN "kvstore-role:write"
AUTHORIZATION_KEY = "authorization"  # request metadata: "Bearer <token>"
AUTH_NONE = "none"  # --auth none: TLS without authentication, on purpose


class Role(enum.Enum):
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"
    NODE = "node"  # another node of the cluster: the peer service and forwarded client requests


_RANK = {Role.READ: 1, Role.WRITE: 2, Role.ADMIN: 3}


def allows(role: Role, required: Role) -> bool:
    """Whether `role` may make a call that needs `required`. Pure.

    Clients are ordered read < write < admin. `node` is apart: only a node may call the peer
    service, and a node may make the reads and writes it forwards for clients, nothing more (no
    admin call: an operator fences, not a node)."""
    if required is Role.NODE or role is Role.NODE:
        return role is Role.NODE and required in (Role.NODE, Role.READ, Role.WRITE)
    return _RANK[role] >= _RANK[required]


# Access of each method: a role, or None for open (no credentials needed). Methods of the
# services below are listed one by one, so that a new RPC must be placed on purpose
# (tests/unit/test_auth.py checks every RPC of the protos is here); anything not listed needs admin.
_METHODS: dict[str, Role | None] = {
    **{f"/kvstore.v1.KVService/{m}": Role.READ for m in ("Get", "Scan", "Watch")},
    **{f"/kvstore.v1.KVService/{m}": Role.WRITE for m in ("Put", "Delete", "Txn", "WriteBatch")},
    **{f"/kvstore.v1.ClusterService/{m}": Role.READ for m in ("ShardMap", "ShardDigest", "ListTransactions",
                                                               "ListPreparedTransactions", "PlacementLog")},
    **{f"/kvstore.v1.ClusterService/{m}": Role.ADMIN for m in ("FenceShard", "Drain", "MoveShard",
                                                                "ResolveTransaction")},
    **{f"/kvstore.internal.v1.PeerService/{m}": Role.NODE for m in ("ScanShards", "LocalShardView", "CheckFenced",
                                                                            "WatchShards", "PrepareTxn", "DecideTxn",
                                                                            "DecideTxnWithPart",
                                                                            "ResolveTxn", "ForgetTxns", "PreparedTxns",
                                                                            "ResolvePrepared", "ReadTxnPart",
                                                                            "ValidateReads", "PlacementRequest")},
}
_SERVICES: dict[str, Role | None] = {
    "kvstore.internal.v1.PeerService": Role.NODE,  # an RPC added later is still node-only
    "grpc.health.v1.Health": None,  # probes: SERVING or not, nothing else
    "grpc.reflection.v1alpha.ServerReflection": Role.READ,
    "grpc.reflection.v1.ServerReflection": Role.READ,
}


def required_role(path: str) -> Role | None:
    """The role a call of `path` ("/package.Service/Method") needs; None: open to anyone. Pure."""
    if path in _METHODS:
        return _METHODS[path]
    service = path.lstrip("/").rpartition("/")[0]
    return _SERVICES.get(service, Role.ADMIN)


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who is calling, as the node knows it: `name` ("token:ci-loader", "cert:dev-write") and the
    role its credentials carry (None: authenticated, but no role)."""

    name: str
    role: Role | None

    def describe(self) -> str:
        return f"{self.name} (role {self.role.value if self.role else 'none'})"


def decide(path: str, identity: Identity) -> None:
    """Raise PermissionDeniedError unless `identity` may call `path`. Pure."""
    required = required_role(path)
    if required is None:
        return
    if identity.role is None:
        raise errors.PermissionDeniedError(
            f"{identity.name} carries no kvstore role (a certificate needs a URI SAN {ROLE_URI_PREFIX}<role>): "
            f"{path} needs role {required.value}")
    if not allows(identity.role, required):
        raise errors.PermissionDeniedError(f"{identity.describe()} may not call {path}: it needs role {required.value}")


# -- tokens -------------------------------------------------------------------------------------


def hash_token(token: str) -> str:
    """What a tokens file stores of a token: its SHA-256, hex. Pure."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text: fits an HTTP header as it is)."""
    return secrets.token_urlsafe(32)


def token_line(token: str, role: Role, name: str) -> str:
    """The tokens-file line that grants `token` the role `role` under `name`. Pure."""
    return f"{hash_token(token)} {role.value} {name}"


def parse_tokens(text: str, source: str = "tokens file") -> dict[str, Identity]:
    """A tokens file: SHA-256 hex of the token -> identity. Pure.

    One token per line: `<sha256 hex of the token> <role> <name>` (role one of read, write,
    admin, node; name one word, shown in logs). Blank lines and `#` comments are skipped. The
    file holds no token itself, only hashes: reading it does not let anyone in."""
    out: dict[str, Identity] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        where = f"{source} line {number}"
        if len(fields) != 3:
            raise ValueError(f"{where}: expected '<sha256 hex> <role> <name>', got {len(fields)} fields")
        digest, role_text, name = fields
        digest = digest.lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{where}: {fields[0][:16]!r}... is not a SHA-256 in hex (64 hex digits); the file holds "
                             "hashes, never tokens (python -m kvstore.server.auth token ROLE NAME)")
        try:
            role = Role(role_text.lower())
        except ValueError:
            raise ValueError(f"{where}: unknown role {role_text!r} (read, write, admin or node)") from None
        if digest in out:
            raise ValueError(f"{where}: the same token is listed twice ({out[digest].name} and token:{name})")
        out[digest] = Identity(f"token:{name}", role)
    if not out:
        raise ValueError(f"{source} lists no token: nobody could authenticate with one")
    return out


def bearer_token(metadata: Iterable[Any]) -> str | None:
    """The token of the request's `authorization: Bearer <token>` metadata; None without one. Raises
    UnauthenticatedError for any other authorization metadata (a scheme this node does not speak,
    several of them). Pure."""
    values = [item[1] for item in metadata if str(item[0]).lower() == AUTHORIZATION_KEY]
    if not values:
        return None
    if len(values) > 1:
        raise errors.UnauthenticatedError("more than one authorization metadata entry")
    value = values[0].decode("utf-8", "replace") if isinstance(values[0], bytes) else str(values[0])
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise errors.UnauthenticatedError("authorization metadata must be 'Bearer <token>'")
    return token.strip()


def certificate_identity(auth_context: Mapping[str, Iterable[bytes]]) -> Identity | None:
    """The identity of a verified client certificate (gRPC fills the auth context only once the
    handshake verified it against the client CA); None without one. Pure."""
    names = [v.decode("utf-8", "replace") for v in auth_context.get("x509_common_name", ())]
    subject = [v.decode("utf-8", "replace") for v in auth_context.get("x509_subject", ())]
    if not names and not subject:
        return None
    uris = {v.decode("utf-8", "replace") for key in ("peer_uri", "x509_subject_alternative_name")
            for v in auth_context.get(key, ())}
    roles = {uri[len(ROLE_URI_PREFIX):] for uri in uris if uri.startswith(ROLE_URI_PREFIX)}
    name = f"cert:{names[0] if names else subject[0]}"
    if len(roles) != 1:  # none, or ambiguous: authenticated, but no role
        return Identity(name, None)
    try:
        return Identity(name, Role(roles.pop()))
    except ValueError:
        return Identity(name, None)


class _RefusalLog:
    """Refusals are logged (identity, role, method, peer), at most `per_window` lines per window:
    a client hammering with a bad token must not flood the log. Lines left out are counted in the
    next window's first line."""

    def __init__(self, per_window: int = 20, window_s: float = 10.0) -> None:
        self._per_window = per_window
        self._window_s = window_s
        self._started = 0.0
        self._logged = 0
        self._skipped = 0

    def __call__(self, path: str, who: str, refusal: errors.StoreError, peer: str) -> None:
        now = time.monotonic()
        if now - self._started >= self._window_s:
            if self._skipped:
                log.warning("%d more refusals were not logged", self._skipped,
                            extra={"event": "refused_unlogged", "count": self._skipped})
            self._started, self._logged, self._skipped = now, 0, 0
        if self._logged >= self._per_window:
            self._skipped += 1
            return
        self._logged += 1
        log.warning("refused %s from %s: %s", path, peer, refusal,
                    extra={"event": "refused", "method": path, "identity": who, "peer": peer,
                           "reason": refusal.reason.value})


class Authorizer:
    """Applies the table to one call (`__call__(path, context)`, what the interceptor calls):
    identifies the caller from its metadata and its connection, then decides. Raises
    UnauthenticatedError or PermissionDeniedError, and logs the refusal."""

    def __init__(self, tokens: Mapping[str, Identity] | None, certificates: bool) -> None:
        self._tokens = dict(tokens) if tokens is not None else None
        self._certificates = certificates
        self._log = _RefusalLog()

    def identify(self, metadata: Iterable[Any], auth_context: Mapping[str, Iterable[bytes]]) -> Identity:
        """Who is calling. A bearer token decides when the node takes tokens (a bad one is refused,
        never passed over for the certificate); else the client certificate. Pure."""
        if self._tokens is not None:
            token = bearer_token(metadata)
            if token is not None:
                identity = self._tokens.get(hash_token(token))
                if identity is None:
                    raise errors.UnauthenticatedError("the bearer token is not valid here")
                return identity
        if self._certificates:
            identity = certificate_identity(auth_context)
            if identity is not None:
                return identity
        wanted = "an 'authorization: Bearer <token>' metadata entry" if self._tokens is not None else \
            "a client certificate"
        raise errors.UnauthenticatedError(f"no credentials: this node needs {wanted}")

    def __call__(self, path: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if required_role(path) is None:
            return
        who = "unauthenticated caller"
        try:
            auth_context = context.auth_context() if self._certificates else {}
            identity = self.identify(context.invocation_metadata() or (), auth_context)
            who = identity.describe()
            decide(path, identity)
        except errors.StoreError as refusal:
            self._log(path, who, refusal, context.peer())
            raise


# -- the node's settings ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """What `serve` runs with: the port's credentials (None: plaintext), the authorizer the
    interceptor calls (None: everyone may do everything), and how this node calls its peers."""

    mode: str
    credentials: grpc.ServerCredentials | None = None
    authorizer: Authorizer | None = None
    peer_credentials: grpc.ChannelCredentials | None = None

    def warning(self, address: str) -> str | None:
        """The startup warning of a node that lets anyone in; None when it authenticates."""
        if self.authorizer is not None:
            return None
        how = "plaintext, no authentication" if self.credentials is None else "TLS without authentication (--auth none)"
        return (f"{how}: anyone who can reach {address} can read and write (and fence shards); "
                "for local development only (docs/security.md)")


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    return data


def _pem(path: str, what: str) -> bytes:
    data = _read(path, what)
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} is not PEM")
    return data


def read_token_file(path: str, what: str = "token file") -> str:
    """A token kept in a file (its first line, whitespace stripped)."""
    lines = _read(path, what).decode("utf-8", "replace").strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(f"{what} {path} holds no token (one line of printable characters without spaces)")
    return token


def certificate_roles(pem: bytes) -> set[str]:
    """The kvstore roles a PEM certificate names in its URI SANs (the node checks its own)."""
    from cryptography import x509  # the server extra; only needed with mutual TLS

    cert = x509.load_pem_x509_certificate(pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {uri[len(ROLE_URI_PREFIX):] for uri in sans.get_values_for_type(x509.UniformResourceIdentifier)
            if uri.startswith(ROLE_URI_PREFIX)}


def load(config: Any) -> ServerSecurity:
    """The node's security from its settings (`NodeConfig`: tls_cert, tls_key, tls_client_ca,
    tokens_file, node_token_file, peer_ca, auth); reads the files. Raises ValueError on a
    contradiction or a file that cannot be used, so a node never starts less secure than asked."""
    cert, key, client_ca = config.tls_cert, config.tls_key, config.tls_client_ca
    tokens_file, node_token_file, peer_ca = config.tokens_file, config.node_token_file, config.peer_ca
    auth = (config.auth or "auto").lower()
    if auth not in ("auto", AUTH_NONE):
        raise ValueError(f"--auth must be 'auto' or 'none', got {config.auth!r}")
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together")
    if not cert:
        given = [flag for flag, value in (("--tls-client-ca", client_ca), ("--tokens-file", tokens_file),
                                          ("--node-token-file", node_token_file), ("--peer-ca", peer_ca)) if value]
        if given:
            raise ValueError(f"{', '.join(given)} need TLS (--tls-cert and --tls-key): credentials never travel "
                             "in plaintext")
        return ServerSecurity("plaintext")
    if auth == AUTH_NONE and (client_ca or tokens_file):
        raise ValueError("--auth none contradicts --tokens-file and --tls-client-ca")
    if auth != AUTH_NONE and not (client_ca or tokens_file):
        raise ValueError("TLS without --tokens-file or --tls-client-ca authenticates nobody: give one of them, or "
                         "--auth none to run TLS without authentication (anyone who reaches the port may then read "
                         "and write)")
    cert_pem, key_pem = _pem(cert, "--tls-cert"), _pem(key, "--tls-key")
    client_ca_pem = _pem(client_ca, "--tls-client-ca") if client_ca else None
    tokens = parse_tokens(_read(tokens_file, "--tokens-file").decode("utf-8", "replace"), tokens_file) \
        if tokens_file else None
    node_token = read_token_file(node_token_file, "--node-token-file") if node_token_file else None
    if tokens is not None and node_token is not None:
        identity = tokens.get(hash_token(node_token))
        if identity is None or identity.role is not Role.NODE:
            raise ValueError(f"--node-token-file {node_token_file}: its token must be in --tokens-file with role node "
                             "(the other nodes check it against the same list)")
    if tokens is not None and client_ca_pem is None and node_token is None:
        raise ValueError("with --tokens-file and no --tls-client-ca the nodes authenticate to each other by a token: "
                         "give --node-token-file (a token of role node in the tokens file)")
    # Mutual TLS: the peers know this node by its certificate, unless they also take tokens and it has one.
    if client_ca_pem is not None and (node_token is None or tokens is None) \
            and "node" not in certificate_roles(cert_pem):
        raise ValueError(f"--tls-cert {cert} has no URI SAN {ROLE_URI_PREFIX}node: the other nodes would refuse "
                         "this node's calls (or, with --tokens-file, give --node-token-file)")
    credentials = grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=client_ca_pem,
                                              require_client_auth=client_ca_pem is not None)
    roots = _pem(peer_ca, "--peer-ca") if peer_ca else client_ca_pem
    # With mutual TLS this node shows its own certificate to its peers (role node in its SAN).
    peer_credentials = grpc.ssl_channel_credentials(
        root_certificates=roots, private_key=key_pem if client_ca_pem else None,
        certificate_chain=cert_pem if client_ca_pem else None)
    if node_token is not None:
        peer_credentials = grpc.composite_channel_credentials(
            peer_credentials, grpc.access_token_call_credentials(node_token))
    if auth == AUTH_NONE:
        return ServerSecurity("tls, no authentication", credentials, None, peer_credentials)
    mode = " + ".join(m for m, on in (("mutual tls", client_ca_pem), ("tokens", tokens)) if on)
    if client_ca_pem is None:
        mode = "tls + " + mode
    return ServerSecurity(mode, credentials, Authorizer(tokens, client_ca_pem is not None), peer_credentials)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvstore.server.auth token ROLE NAME`: a new token and its tokens-file line."""
    args = list(sys.argv[1:] if argv is None else argv)
    roles = [r.value for r in Role]
    if len(args) != 3 or args[0] != "token" or args[1] not in roles:
        print(f"usage: python -m kvstore.server.auth token {{{','.join(roles)}}} NAME\n"
              "prints a new token (give it to the caller) and the line to add to the nodes' --tokens-file",
              file=sys.stderr)
        return 2
    token = new_token()
    print(f"token: {token}")
    print(f"tokens-file line: {token_line(token, Role(args[1]), args[2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
