"""A development certificate authority for `make up --tls/--mtls/--secure` (`cryptography`).

`DevCA(directory).ensure(node_ids)` writes, under `directory` (the dev cluster's `.data/tls/`):

    ca.pem, ca.key                  the CA (ECDSA P-256, 10 years), self-signed
    <node>.pem, <node>.key          one per node: server certificate (SAN 127.0.0.1, ::1, localhost)
                                    and client certificate for its peers (URI SAN kvstore-role:node)
    read.pem/.key, write.pem/.key,  client certificates of the roles (mutual TLS), CN dev-<role>,
    admin.pem/.key                  URI SAN kvstore-role:<role>
    read.token, write.token,        bearer tokens of the roles, and the nodes' own token
    admin.token, node.token
    tokens                          the nodes' --tokens-file: the SHA-256 of each token, its role, a name

Keys and tokens are mode 0600. Everything is reused across runs (a client keeps working after a
restart); a certificate is issued again only when it is missing, no longer verifies against the
CA, or expires within 30 days. For development only: the CA's key lies next to what it signed.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvstore.server.auth import ROLE_URI_PREFIX, Role, new_token, token_line

CLIENT_ROLES = (Role.READ, Role.WRITE, Role.ADMIN)
CA_DAYS = 3650
LEAF_DAYS = 825
RENEW_BEFORE_DAYS = 30


@dataclasses.dataclass(frozen=True)
class Credential:
    cert: Path
    key: Path


@dataclasses.dataclass(frozen=True)
class DevPki:
    """The paths `DevCA.ensure` wrote."""

    directory: Path
    ca: Path
    nodes: dict[str, Credential]
    clients: dict[str, Credential]  # role -> client certificate
    tokens: dict[str, Path]  # role (read, write, admin, node) -> file holding the token
    tokens_file: Path  # the hashes, for the nodes' --tokens-file


def _write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only (created 0600, never briefly wider)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class DevCA:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def ensure(self, node_ids: Sequence[str]) -> DevPki:
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        ca_cert, ca_key = self._ca()
        nodes = {node: self._leaf(ca_cert, ca_key, node, node, Role.NODE, server=True) for node in node_ids}
        clients = {role.value: self._leaf(ca_cert, ca_key, role.value, f"dev-{role.value}", role, server=False)
                   for role in CLIENT_ROLES}
        tokens: dict[str, Path] = {}
        lines = ["# kvstore tokens (docs/security.md): <sha256 hex of the token> <role> <name>"]
        for role in (*CLIENT_ROLES, Role.NODE):
            path = self.directory / f"{role.value}.token"
            token = path.read_text().strip() if path.exists() else ""
            if not token:
                token = new_token()
                _write_private(path, (token + "\n").encode())
            tokens[role.value] = path
            lines.append(token_line(token, role, f"dev-{role.value}"))
        tokens_file = self.directory / "tokens"
        tokens_file.write_text("\n".join(lines) + "\n")
        return DevPki(self.directory, self.directory / "ca.pem", nodes, clients, tokens, tokens_file)

    def _ca(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        cert_path, key_path = self.directory / "ca.pem", self.directory / "ca.key"
        if cert_path.exists() and key_path.exists():
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            if isinstance(key, ec.EllipticCurvePrivateKey) and cert.not_valid_after_utc - _now() > \
                    datetime.timedelta(days=RENEW_BEFORE_DAYS):
                return cert, key
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvstore development"),
                          x509.NameAttribute(NameOID.COMMON_NAME, "kvstore dev CA")])
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        _write_private(key_path, _key_pem(key))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cert, key

    def _leaf(self, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, stem: str, common_name: str,
              role: Role, *, server: bool) -> Credential:
        cert_path, key_path = self.directory / f"{stem}.pem", self.directory / f"{stem}.key"
        if cert_path.exists() and key_path.exists() and _still_good(cert_path.read_bytes(), ca_cert):
            return Credential(cert_path, key_path)
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(f"{ROLE_URI_PREFIX}{role.value}")]
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server:
            names += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                      x509.IPAddress(ipaddress.ip_address("::1"))]
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        now = _now()
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvstore development"),
                                         x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write_private(key_path, _key_pem(key))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Credential(cert_path, key_path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _still_good(pem: bytes, ca_cert: x509.Certificate) -> bool:
    """Signed by this CA and valid for more than RENEW_BEFORE_DAYS."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return cert.not_valid_after_utc - _now() > datetime.timedelta(days=RENEW_BEFORE_DAYS)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvstore.dev.ca DIR [NODE...]`: create or refresh a development PKI."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print("usage: python -m kvstore.dev.ca DIR [NODE_ID...]  (default nodes: node-1 node-2 node-3)",
              file=sys.stderr)
        return 2
    pki = DevCA(Path(args[0])).ensure(args[1:] or ["node-1", "node-2", "node-3"])
    print(f"CA: {pki.ca}\ntokens file (hashes): {pki.tokens_file}")
    for role, path in pki.tokens.items():
        print(f"token {role}: {path}")
    for role, cred in pki.clients.items():
        print(f"certificate {role}: {cred.cert} {cred.key}")
    for node, cred in pki.nodes.items():
        print(f"node {node}: {cred.cert} {cred.key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
