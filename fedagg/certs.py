"""Certificates and keys for a Flower deployment (``fedagg certs``).

A deployment needs three kinds of key material:

1. a certificate authority (CA) that the SuperLink's TLS certificate chains to; every
   institution and every ``flwr`` CLI user gets the CA *certificate* (``ca.crt``) and checks the
   SuperLink against it (``flower-supernode --root-certificates``, ``root-certificates`` in
   ``$FLWR_HOME/config.toml``);
2. the SuperLink's TLS server certificate, signed by the CA, with the host names / IP addresses
   the sites dial as subject alternative names (``flower-superlink --ssl-certfile --ssl-keyfile
   --ssl-ca-certfile``);
3. one authentication key pair per site (SuperNode authentication, ``flower-superlink
   --enable-supernode-auth``). Flower 1.42 expects an ECDSA key on a NIST curve: the private key
   in OpenSSH format (``flower-supernode --auth-supernode-private-key``, read with
   ``load_ssh_private_key(data, None)``, hence unencrypted) and the public key as an OpenSSH
   line ``ecdsa-sha2-nistp384 AAAA... comment`` (``flwr supernode register <file> <connection>``).

All keys are ECDSA P-384 (SECP384R1), signatures SHA-384. Everything is generated with the
``cryptography`` package; nothing shells out to ``openssl``.

Files are written as follows (``DIR`` is created 0700, private keys 0600, the rest 0644)::

    DIR/ca/ca.crt                 CA certificate: give to every site and CLI user
    DIR/ca/ca.key                 CA private key: keep offline, never copy to a server
    DIR/superlink/ca.crt          copy of the CA certificate (--ssl-ca-certfile)
    DIR/superlink/server.crt      SuperLink certificate (--ssl-certfile)
    DIR/superlink/server.key      its private key (--ssl-keyfile)
    DIR/sites/<site>/ca.crt       copy of the CA certificate (--root-certificates)
    DIR/sites/<site>/auth.key     the site's SuperNode private key (--auth-supernode-private-key)
    DIR/sites/<site>/auth.pub     its public key (register it on the SuperLink)

Existing files are never overwritten unless ``force=True``; the check covers every file before
the first one is written, so a refused call leaves the directory untouched. No function here
logs, prints or puts key material in an error message or a ``repr``.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedagg.errors import ConfigError, explain
from fedagg.report import atomic_write_bytes

__all__ = [
    "CertFiles",
    "CurveKey",
    "create_certs",
    "make_ca",
    "make_server_cert",
    "make_site_key",
    "parse_san",
    "parse_sites",
    "ssh_private_bytes",
    "ssh_public_line",
]

_log = logging.getLogger(__name__)

CurveKey = ec.EllipticCurvePrivateKey
"""The private-key type used throughout (ECDSA, SECP384R1)."""

_SITE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_DNS_LABEL_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_PRIVATE_MODE = 0o600
_PUBLIC_MODE = 0o644
_DIR_MODE = 0o700


def _new_key() -> CurveKey:
    return ec.generate_private_key(ec.SECP384R1())


def _utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def parse_san(value: str) -> x509.GeneralName:
    """One subject alternative name: an IP address, or else a DNS name.

    Parameters
    ----------
    value : str
        ``"127.0.0.1"``, ``"::1"``, ``"superlink.example.org"``, ``"localhost"`` or a wildcard
        ``"*.example.org"``.

    Returns
    -------
    x509.GeneralName
        :class:`x509.IPAddress` or :class:`x509.DNSName`.

    Raises
    ------
    ConfigError
        If ``value`` is neither an IP address nor a valid DNS name.
    """
    text = value.strip()
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    if labels and labels[0] == "*":
        labels = labels[1:]
    if (not text or len(text) > 253 or not labels
            or not all(_DNS_LABEL_RE.match(label) for label in labels)):
        raise ConfigError(explain("san", value,
                                  "must be an IP address or a DNS name (letters, digits, '-', '.')",
                                  "pass the host name or address the sites dial, e.g. "
                                  "--san superlink.example.org --san 203.0.113.10"))
    return x509.DNSName(text.rstrip("."))


def parse_sites(sites: str | Iterable[str]) -> list[str]:
    """Site names from ``"a,b,c"`` or an iterable; each unique and file-name safe.

    Raises
    ------
    ConfigError
        If a name is empty, repeated, or not ``[A-Za-z0-9][A-Za-z0-9._-]{0,62}``.
    """
    raw = sites.split(",") if isinstance(sites, str) else list(sites)
    names = [s.strip() for s in raw if s.strip()]
    if not names:
        raise ConfigError(explain("sites", sites, "needs at least one site name",
                                  "pass --sites site-a,site-b"))
    for name in names:
        if not _SITE_RE.match(name):
            raise ConfigError(explain("sites", name,
                                      "a site name is 1-63 characters of letters, digits, '.', "
                                      "'_' or '-', starting with a letter or digit",
                                      "rename the site, e.g. 'hospital-a'"))
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(explain("sites", dupes, "site names must be unique",
                                  "list each site once"))
    return names


def make_ca(common_name: str = "fedagg deployment CA", *, days: int = 3650,
            now: _dt.datetime | None = None,
            key: CurveKey | None = None) -> tuple[CurveKey, x509.Certificate]:
    """A self-signed CA certificate (path length 0: it signs leaf certificates only).

    Parameters
    ----------
    common_name : str
        Subject CN of the CA.
    days : int
        Validity in days from ``now``.
    now : datetime, optional
        Start of validity (UTC); defaults to the current time.
    key : EllipticCurvePrivateKey, optional
        The CA key; a fresh P-384 key by default.

    Returns
    -------
    tuple
        ``(ca_key, ca_cert)``.
    """
    start = now or _utcnow()
    ca_key = key or _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedagg")])
    ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - _dt.timedelta(minutes=5))
        .not_valid_after(start + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ski, critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    return ca_key, cert


def make_server_cert(ca_key: CurveKey, ca_cert: x509.Certificate, sans: Sequence[str], *,
                     days: int = 825, now: _dt.datetime | None = None,
                     key: CurveKey | None = None) -> tuple[CurveKey, x509.Certificate]:
    """The SuperLink's TLS server certificate, signed by the CA.

    Parameters
    ----------
    ca_key, ca_cert
        The CA from :func:`make_ca`.
    sans : sequence of str
        Host names and IP addresses the sites and CLI users dial (at least one). The first is
        also the subject CN.
    days : int
        Validity in days from ``now``.
    now : datetime, optional
        Start of validity (UTC); defaults to the current time.
    key : EllipticCurvePrivateKey, optional
        The server key; a fresh P-384 key by default.

    Returns
    -------
    tuple
        ``(server_key, server_cert)``.

    Raises
    ------
    ConfigError
        If ``sans`` is empty or holds an invalid name.
    """
    if not sans:
        raise ConfigError(explain("san", list(sans), "the server certificate needs at least one "
                                  "subject alternative name",
                                  "pass --san with the SuperLink's host name or IP address"))
    names = [parse_san(s) for s in sans]
    start = now or _utcnow()
    server_key = key or _new_key()
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(sans[0]).strip()),
                                 x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedagg")]))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - _dt.timedelta(minutes=5))
        .not_valid_after(start + _dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=True, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                       critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    return server_key, cert


def make_site_key() -> CurveKey:
    """A fresh SuperNode authentication key (ECDSA P-384, as Flower 1.42 expects)."""
    return _new_key()


def ssh_private_bytes(key: CurveKey) -> bytes:
    """The private key as an unencrypted OpenSSH PEM block (``--auth-supernode-private-key``)."""
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption())


def ssh_public_line(key: CurveKey, comment: str = "") -> bytes:
    """The public key as one OpenSSH line ``ecdsa-sha2-nistp384 AAAA... [comment]\\n``."""
    line = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH)
    if comment:
        line += b" " + comment.encode("ascii")
    return line + b"\n"


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: CurveKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass(frozen=True)
class CertFiles:
    """Paths written by :func:`create_certs` (paths only: no key material)."""

    out: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    server_ca_cert: Path
    sans: tuple[str, ...]
    site_keys: dict[str, Path] = field(default_factory=dict)
    site_public_keys: dict[str, Path] = field(default_factory=dict)
    site_ca_certs: dict[str, Path] = field(default_factory=dict)

    def all_paths(self) -> list[Path]:
        """Every file, in the order they are written."""
        paths = [self.ca_cert, self.ca_key, self.server_ca_cert, self.server_cert,
                 self.server_key]
        for site in self.site_keys:
            paths += [self.site_ca_certs[site], self.site_keys[site], self.site_public_keys[site]]
        return paths


def _layout(out: Path, sans: Sequence[str], sites: Sequence[str]) -> CertFiles:
    sl = out / "superlink"
    return CertFiles(
        out=out, ca_cert=out / "ca" / "ca.crt", ca_key=out / "ca" / "ca.key",
        server_cert=sl / "server.crt", server_key=sl / "server.key", server_ca_cert=sl / "ca.crt",
        sans=tuple(sans),
        site_keys={s: out / "sites" / s / "auth.key" for s in sites},
        site_public_keys={s: out / "sites" / s / "auth.pub" for s in sites},
        site_ca_certs={s: out / "sites" / s / "ca.crt" for s in sites},
    )


def _mkdir_private(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, _DIR_MODE)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` atomically with ``mode`` (set on the temp file before any byte lands)."""
    _mkdir_private(path.parent)
    atomic_write_bytes(path, data, mode=mode)


def create_certs(out: str | Path, sans: Sequence[str], sites: str | Iterable[str], *,
                 force: bool = False, ca_days: int = 3650, server_days: int = 825,
                 now: _dt.datetime | None = None) -> CertFiles:
    """Create the CA, the SuperLink certificate and one authentication key pair per site.

    Parameters
    ----------
    out : str or Path
        Output directory (created 0700; see the module docstring for the layout).
    sans : sequence of str
        Subject alternative names of the SuperLink certificate (``--san``).
    sites : str or iterable of str
        Site names, ``"a,b,c"`` or a list.
    force : bool
        Overwrite existing files. Without it, any existing target file refuses the whole call
        before anything is written.
    ca_days, server_days : int
        Validity of the CA and of the server certificate, in days.
    now : datetime, optional
        Start of validity (UTC); defaults to the current time.

    Returns
    -------
    CertFiles
        The paths written.

    Raises
    ------
    ConfigError
        Bad SAN or site name, non-positive validity, or existing files without ``force``.
    """
    for name, days in (("ca_days", ca_days), ("server_days", server_days)):
        if days < 1:
            raise ConfigError(explain(name, days, "must be >= 1", "pass a validity in days"))
    if not sans:
        raise ConfigError(explain("san", [], "the server certificate needs at least one subject "
                                  "alternative name",
                                  "pass --san with the SuperLink's host name or IP address"))
    for s in sans:
        parse_san(s)
    names = parse_sites(sites)
    root = Path(out)
    files = _layout(root, sans, names)
    existing = [p for p in files.all_paths() if p.exists()]
    if existing and not force:
        shown = [str(p.relative_to(root)) for p in existing[:5]]
        raise ConfigError(explain("out", str(root),
                                  f"already holds {len(existing)} of the files to write "
                                  f"({', '.join(shown)}{', ...' if len(existing) > 5 else ''})",
                                  "choose another directory, or pass --force to replace them "
                                  "(sites then need their new keys and the new ca.crt)"))
    _mkdir_private(root)
    start = now or _utcnow()
    ca_key, ca_cert = make_ca(days=ca_days, now=start)
    server_key, server_cert = make_server_cert(ca_key, ca_cert, sans, days=server_days, now=start)
    ca_pem = _pem_cert(ca_cert)
    _write(files.ca_cert, ca_pem, _PUBLIC_MODE)
    _write(files.ca_key, _pem_key(ca_key), _PRIVATE_MODE)
    _write(files.server_ca_cert, ca_pem, _PUBLIC_MODE)
    _write(files.server_cert, _pem_cert(server_cert), _PUBLIC_MODE)
    _write(files.server_key, _pem_key(server_key), _PRIVATE_MODE)
    for site in names:
        key = make_site_key()
        _write(files.site_ca_certs[site], ca_pem, _PUBLIC_MODE)
        _write(files.site_keys[site], ssh_private_bytes(key), _PRIVATE_MODE)
        _write(files.site_public_keys[site], ssh_public_line(key, f"fedagg-{site}"), _PUBLIC_MODE)
    for d in {root, root / "sites", *(p.parent for p in files.all_paths())}:
        os.chmod(d, _DIR_MODE)
    _log.info("wrote CA, SuperLink certificate (SANs %s) and keys for %d sites under %s",
              ", ".join(sans), len(names), root)
    return files
