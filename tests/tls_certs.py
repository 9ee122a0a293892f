"""Certificates for TLS tests, made with the openssl command in a temporary folder: a CA, a server
certificate it signs for 127.0.0.1 and localhost, and a client certificate it signs."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvferry.testing.store_servers import ServerTLS


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server(self, check_clients: bool = True) -> ServerTLS:
        return ServerTLS(self.server_cert, self.server_key, self.ca, check_clients)


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    assert exe, "the openssl command is needed to make test certificates (apt-get install openssl)"
    subprocess.run([exe, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(d: Path, name: str, subject: str, ca: str, ext: str) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", subject, cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


def make_certs(d: Path, ca_name: str = "ca") -> Certs:
    """A fresh CA (`ca_name`) and the server and client certificates it signed, under `d`."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca_name}.key", "-out", f"{ca_name}.crt",
             "-days", "2", "-subj", f"/CN=kvferry test {ca_name}", cwd=d)
    _signed(d, f"{ca_name}-server", "/CN=127.0.0.1", ca_name,
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _signed(d, f"{ca_name}-client", "/CN=kvferry-client", ca_name, "extendedKeyUsage=clientAuth\n")
    return Certs(d / f"{ca_name}.crt", d / f"{ca_name}-server.crt", d / f"{ca_name}-server.key",
                 d / f"{ca_name}-client.crt", d / f"{ca_name}-client.key")
