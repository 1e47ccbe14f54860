"""``fedagg certs``: chain, SANs, key formats Flower accepts, permissions, overwrite rules.

The TLS checks are real handshakes over 127.0.0.1 with Python's ``ssl`` module, and the key
checks use Flower's own loaders (what ``flower-supernode`` and ``flwr supernode register`` call).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (
    load_pem_private_key,
    load_ssh_private_key,
    load_ssh_public_key,
)
from cryptography.x509.verification import PolicyBuilder, Store

from fedagg.certs import CertFiles, create_certs, parse_san, parse_sites
from fedagg.cli import main
from fedagg.errors import ConfigError

SITES = ["site-a", "site-b", "site-c"]


@pytest.fixture()
def files(tmp_path: Path) -> CertFiles:
    return create_certs(tmp_path / "certs", ["127.0.0.1", "localhost"], ",".join(SITES))


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_server_cert_chains_to_ca_with_sans(files: CertFiles) -> None:
    ca, server = _cert(files.ca_cert), _cert(files.server_cert)
    server.verify_directly_issued_by(ca)
    store = Store([ca])
    for name in (x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")):
        verifier = PolicyBuilder().store(store).build_server_verifier(name)
        chain = verifier.verify(server, [])
        assert chain[-1] == ca
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # A name outside the SANs does not verify.
    with pytest.raises(x509.verification.VerificationError):
        PolicyBuilder().store(store).build_server_verifier(
            x509.DNSName("other.example.org")).verify(server, [])
    # Every copy of the CA certificate is the same certificate.
    assert files.server_ca_cert.read_bytes() == files.ca_cert.read_bytes()
    for site in SITES:
        assert files.site_ca_certs[site].read_bytes() == files.ca_cert.read_bytes()


def _tls_handshake(files: CertFiles, cafile: Path, server_hostname: str) -> None:
    """Real TLS over 127.0.0.1: a server with the SuperLink cert, a client trusting ``cafile``."""
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(files.server_cert, files.server_key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with sctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"ok")
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        cctx = ssl.create_default_context(cafile=str(cafile))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                cctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
            assert tls.recv(2) == b"ok"
    finally:
        thread.join(10)
        listener.close()


def test_real_tls_handshake_trusts_only_our_ca(files: CertFiles, tmp_path: Path) -> None:
    _tls_handshake(files, files.ca_cert, "127.0.0.1")
    _tls_handshake(files, files.site_ca_certs["site-a"], "localhost")
    other = create_certs(tmp_path / "other", ["127.0.0.1"], "x")
    with pytest.raises(ssl.SSLCertVerificationError):
        _tls_handshake(files, other.ca_cert, "127.0.0.1")
    with pytest.raises(ssl.SSLCertVerificationError):
        _tls_handshake(files, files.ca_cert, "superlink.example.org")


def test_site_keys_load_as_flower_loads_them(files: CertFiles) -> None:
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    seen = set()
    for site in SITES:
        # flower-supernode: load_ssh_private_key(data, None) and an EC key.
        priv = load_ssh_private_key(files.site_keys[site].read_bytes(), None)
        assert isinstance(priv, ec.EllipticCurvePrivateKey)
        assert priv.curve.name == "secp384r1"
        # flwr supernode register: an OpenSSH public key on a NIST curve.
        line = files.site_public_keys[site].read_text()
        assert line.startswith("ecdsa-sha2-nistp384 ") and line.rstrip().endswith(f"fedagg-{site}")
        registered = try_load_public_key(files.site_public_keys[site])
        assert registered == public_key_to_bytes(priv.public_key())
        pub = load_ssh_public_key(line.encode())
        assert isinstance(pub, ec.EllipticCurvePublicKey)
        assert pub.public_numbers() == priv.public_key().public_numbers()
        seen.add(registered)
    assert len(seen) == len(SITES)  # one distinct key per site
    server_key = load_pem_private_key(files.server_key.read_bytes(), None)
    assert server_key.public_key().public_numbers() == \
        _cert(files.server_cert).public_key().public_numbers()  # type: ignore[union-attr]


def test_permissions_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        f = create_certs(tmp_path / "c", ["127.0.0.1"], "a,b")
    finally:
        os.umask(old)
    private = [f.ca_key, f.server_key, *f.site_keys.values()]
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for path in f.all_paths():
        if path not in private:
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    dirs = {f.out, f.out / "sites", *(p.parent for p in f.all_paths())}
    for d in dirs:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert not list(f.out.rglob("*.tmp"))


def test_refuses_to_overwrite_and_leaves_files_untouched(files: CertFiles) -> None:
    before = {p: p.read_bytes() for p in files.all_paths()}
    with pytest.raises(ConfigError, match="--force"):
        create_certs(files.out, ["127.0.0.1"], ",".join(SITES))
    # Also refused when only one file of the new layout exists (a site added later).
    with pytest.raises(ConfigError, match="already holds"):
        create_certs(files.out, ["127.0.0.1"], "new-site")
    assert {p: p.read_bytes() for p in files.all_paths()} == before
    assert not (files.out / "sites" / "new-site").exists()


def test_cli_refuses_then_force_replaces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c"
    args = ["certs", "--out", str(out), "--san", "127.0.0.1", "--san", "localhost", "--sites",
            "site-a,site-b"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "flwr supernode register" in printed and "site-b" in printed
    ca_before = (out / "ca" / "ca.crt").read_bytes()
    key_before = (out / "sites" / "site-a" / "auth.key").read_bytes()
    for secret in (key_before, (out / "ca" / "ca.key").read_bytes()):
        body = secret.decode().splitlines()[1]
        assert body not in printed  # no key material on stdout
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already holds" in err and "Fix:" in err and "Traceback" not in err
    assert (out / "ca" / "ca.crt").read_bytes() == ca_before
    assert main([*args, "--force"]) == 0
    assert (out / "ca" / "ca.crt").read_bytes() != ca_before
    assert (out / "sites" / "site-a" / "auth.key").read_bytes() != key_before
    new_ca = _cert(out / "ca" / "ca.crt")
    _cert(out / "superlink" / "server.crt").verify_directly_issued_by(new_ca)
    assert stat.S_IMODE((out / "sites" / "site-a" / "auth.key").stat().st_mode) == 0o600


@pytest.mark.parametrize("bad", ["", "bad name", "-x.org", "a..b", "x" * 64 + ".org"])
def test_bad_san_is_refused_with_a_fix(bad: str) -> None:
    with pytest.raises(ConfigError, match="Fix:"):
        parse_san(bad)


def test_san_kinds() -> None:
    assert isinstance(parse_san("::1"), x509.IPAddress)
    assert isinstance(parse_san("10.0.0.7"), x509.IPAddress)
    assert parse_san("*.example.org") == x509.DNSName("*.example.org")
    assert parse_san("superlink.example.org.") == x509.DNSName("superlink.example.org")


@pytest.mark.parametrize("bad", ["", ",", "a,a", "../etc", "has space", "-lead", "x" * 64])
def test_bad_site_names_are_refused(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Fix:"):
        parse_sites(bad)
    with pytest.raises(ConfigError):
        create_certs(tmp_path / "c", ["127.0.0.1"], bad)
    assert not (tmp_path / "c").exists()


def test_no_sans_or_bad_days_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="san"):
        create_certs(tmp_path / "c", [], "a")
    with pytest.raises(ConfigError, match="server_days"):
        create_certs(tmp_path / "c", ["127.0.0.1"], "a", server_days=0)
    assert not (tmp_path / "c").exists()


def test_paths_object_holds_no_key_material(files: CertFiles) -> None:
    text = repr(files)
    assert "PRIVATE" not in text and "BEGIN" not in text
