"""How the client connects: plaintext, or TLS with the cluster's CA, a client certificate (mutual
TLS) and/or a bearer token (docs/security.md).

`ClientSecurity` holds the settings; `ClientSecurity.from_env()` reads them from KVSTORE_CA,
KVSTORE_CERT, KVSTORE_KEY, KVSTORE_TOKEN and KVSTORE_TOKEN_FILE (explicit values override them,
as the CLI's --ca, --cert, --key, --token, --token-file do). TLS is on as soon as any of them is
set; a token is only ever sent over TLS (`grpc.access_token_call_credentials`: an
`authorization: Bearer <token>` entry on every call). `channel` opens a channel with them, for the
client's own connections and for tools that call a stub directly.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvstore.client.errors import InvalidArgument

CA_ENV = "KVSTORE_CA"
CERT_ENV = "KVSTORE_CERT"
KEY_ENV = "KVSTORE_KEY"
TOKEN_ENV = "KVSTORE_TOKEN"
TOKEN_FILE_ENV = "KVSTORE_TOKEN_FILE"
ENV_VARS = (CA_ENV, CERT_ENV, KEY_ENV, TOKEN_ENV, TOKEN_FILE_ENV)


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """`ca`: the CA file (PEM) that signed the nodes' certificates ("" with TLS: the system's
    roots); `cert`/`key`: this client's certificate and key (mutual TLS; the certificate carries
    the role); `token`: a bearer token. All empty: plaintext."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    token: str = dataclasses.field(default="", repr=False)

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert or self.key or self.token)

    def describe(self) -> str:
        if not self.tls:
            return "plaintext"
        parts = ["tls"] + (["client certificate"] if self.cert else []) + (["token"] if self.token else [])
        return " + ".join(parts)

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None, *, ca: str | None = None, cert: str | None = None,
                 key: str | None = None, token: str | None = None, token_file: str | None = None) -> ClientSecurity:
        """Explicit values (flags) over the environment (KVSTORE_CA, KVSTORE_CERT, KVSTORE_KEY,
        KVSTORE_TOKEN, KVSTORE_TOKEN_FILE). A token given either way wins over a token file of the
        other: --token over KVSTORE_TOKEN_FILE, --token-file over KVSTORE_TOKEN."""
        env = os.environ if environ is None else environ
        if token is None and token_file is None:
            token, token_file = env.get(TOKEN_ENV) or None, env.get(TOKEN_FILE_ENV) or None
        secret = token.strip() if token else read_token(token_file) if token_file else ""
        security = ClientSecurity(ca=ca if ca is not None else env.get(CA_ENV, ""),
                                  cert=cert if cert is not None else env.get(CERT_ENV, ""),
                                  key=key if key is not None else env.get(KEY_ENV, ""), token=secret)
        security.validate()
        return security

    def validate(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument("a client certificate needs its key and a key its certificate (--cert and --key, "
                                  f"or {CERT_ENV} and {KEY_ENV})")
        if any(c.isspace() or not c.isprintable() for c in self.token):
            raise InvalidArgument("the token must be one word of printable characters")

    def environ(self) -> dict[str, str]:
        """These settings as KVSTORE_* variables, for code that reads them itself (a Spark
        executor, the demo's own clients)."""
        return {CA_ENV: self.ca, CERT_ENV: self.cert, KEY_ENV: self.key, TOKEN_ENV: self.token, TOKEN_FILE_ENV: ""}

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The channel credentials; None for plaintext. Reads the files (raises InvalidArgument)."""
        if not self.tls:
            return None
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA") if self.ca else None,
            private_key=_read(self.key, "client key") if self.key else None,
            certificate_chain=_read(self.cert, "client certificate") if self.cert else None)
        if self.token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(self.token))
        return credentials

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to `target` with these settings (the caller closes it)."""
        credentials = self.credentials()
        if credentials is None:
            return grpc.insecure_channel(target, options=list(options))
        return grpc.secure_channel(target, credentials, options=list(options))


def read_token(path: str) -> str:
    """The token in a file: its first line, whitespace stripped."""
    try:
        lines = Path(path).read_text().strip().splitlines()
    except OSError as exc:
        raise InvalidArgument(f"token file {path}: {exc.strerror or exc}") from None
    if not lines or not lines[0].strip():
        raise InvalidArgument(f"token file {path} is empty")
    return lines[0].strip()


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{what} file {path}: {exc.strerror or exc}") from None


def open_channel(target: str, security: ClientSecurity | None = None) -> grpc.Channel:
    """A channel to `target` with `security`, or with the KVSTORE_* environment when None."""
    return (security if security is not None else ClientSecurity.from_env()).channel(target)
