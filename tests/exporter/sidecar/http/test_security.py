"""HTTP protection (TLS, basic auth), socket permissions, peer uids and the cardinality guards."""

from __future__ import annotations

import base64
import http.client
import os
import shutil
import socket
import ssl
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest

from exporter.config import apply_web_config, config_from_data, web_config_layer
from exporter.errors import ConfigError, ErrorCode
from exporter.protocol.messages import ErrorMessage, Welcome
from exporter.sidecar.http.security import MAX_CONCURRENT_CHECKS, BasicAuth
from tests.helpers import (
    LOOP_WAIT_SECONDS,
    RawClient,
    SidecarThread,
    counter,
    hello,
    http_get,
    self_signed_cert,
    sidecar_config,
    snapshot,
    wait_until,
)

PASSWORD = "s3cret"


@pytest.fixture(scope="module")
def password_hash() -> str:
    return bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    return self_signed_cert(tmp_path)


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture
def auth_sidecar(socket_dir: Path, password_hash: str) -> Iterator[SidecarThread]:
    running = SidecarThread(sidecar_config(socket_dir / "m.sock", http={"basic_auth_users": {"prom": password_hash}})).start()
    try:
        yield running
    finally:
        running.stop()


def test_basic_auth_guards_everything_but_the_probes(auth_sidecar: SidecarThread) -> None:
    url = auth_sidecar.url
    status, _, headers = http_get(url + "/metrics")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")
    assert http_get(url + "/metrics", _basic("prom", "wrong"))[0] == 401
    assert http_get(url + "/metrics", _basic("nobody", PASSWORD))[0] == 401
    assert http_get(url + "/metrics", {"Authorization": "Basic !!!notbase64"})[0] == 401
    assert http_get(url + "/api/v1/ranks")[0] == 401
    status, body, _ = http_get(url + "/metrics", _basic("prom", PASSWORD))
    assert status == 200 and b"hicache_exporter_build_info" in body
    assert http_get(url + "/metrics", _basic("prom", PASSWORD))[0] == 200  # cached verification
    assert http_get(url + "/-/healthy")[0] == 200 and http_get(url + "/-/ready")[0] == 200


def test_wrong_passwords_in_flood_never_hold_up_the_probes(socket_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bcrypt ran on the event loop: sixteen clients with wrong passwords held /-/healthy for seconds.

    Every password check is held until the probes are answered, so no probe may wait for any check:
    on the loop, the first held check would stop every probe. No timing is measured."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    release = threading.Event()
    entered: list[str] = []
    check = BasicAuth._check

    def held_check(self: BasicAuth, user: str, password: str) -> bool:
        entered.append(user)
        release.wait(LOOP_WAIT_SECONDS)
        return check(self, user, password)

    monkeypatch.setattr(BasicAuth, "_check", held_check)
    running = SidecarThread(sidecar_config(socket_dir / "m.sock", http={"basic_auth_users": {"prom": hashed}})).start()
    stop = threading.Event()
    codes: list[int] = []

    def attacker() -> None:
        while not stop.is_set():
            codes.append(http_get(running.url + "/metrics", _basic("prom", "wrong"))[0])

    attackers = [threading.Thread(target=attacker, daemon=True) for _ in range(16)]
    try:
        for thread in attackers:
            thread.start()
        wait_until(lambda: len(entered) >= MAX_CONCURRENT_CHECKS)  # every checking thread is held: the flood is under way
        for _ in range(20):
            assert http_get(running.url + "/-/healthy")[0] == 200
    finally:
        release.set()
        stop.set()
        for thread in attackers:
            thread.join(30)
    try:
        assert codes and set(codes) <= {401, 429}
        assert http_get(running.url + "/metrics", _basic("prom", PASSWORD))[0] == 200  # the real user still gets in
    finally:
        running.stop()


def test_plain_text_passwords_are_refused_in_config() -> None:
    with pytest.raises(ConfigError, match="http.basic_auth_users"):
        config_from_data({"http": {"basic_auth_users": {"prom": "hunter2"}}}, "test")


def test_tls_serves_metrics_over_https(socket_dir: Path, tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    config = sidecar_config(socket_dir / "m.sock", http={"tls_server_config": {"cert_file": str(cert), "key_file": str(key)}})
    running = SidecarThread(config).start()
    try:
        assert running.sidecar is not None
        context = ssl.create_default_context(cafile=str(cert))
        url = f"https://127.0.0.1:{running.sidecar.http_port}/metrics"
        with urllib.request.urlopen(url, context=context, timeout=10) as resp:
            assert resp.status == 200 and b"hicache_exporter_build_info" in resp.read()
        with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP on a TLS port is not served
            http_get(f"http://127.0.0.1:{running.sidecar.http_port}/metrics")
    finally:
        running.stop()


def test_unreadable_tls_files_stop_start_up_with_the_file_named(socket_dir: Path, tmp_path: Path) -> None:
    config = sidecar_config(socket_dir / "m.sock", http={"tls_server_config": {
        "cert_file": str(tmp_path / "missing.pem"), "key_file": str(tmp_path / "missing.key")}})
    with pytest.raises(ConfigError, match="missing.pem"):
        SidecarThread(config).start()
    assert not (socket_dir / "m.sock").exists(), "nothing is bound before the TLS files load"


def test_socket_and_directory_modes(socket_dir: Path) -> None:
    path = socket_dir / "fresh" / "metrics.sock"
    running = SidecarThread(sidecar_config(path, ingest={"socket_mode": "0600", "dir_mode": "0700"})).start()
    try:
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    finally:
        running.stop()
    assert not path.exists()


def _connect_as(uid: int, path: str) -> str:
    """Connect from a child process running as `uid`; returns what happened, as text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop privileges, then try the socket
        os.close(read_end)
        try:
            os.setgid(uid)
            os.setuid(uid)
            client = RawClient(path, timeout=5)
            reply = client.recv()
            outcome = f"reply:{reply.code}" if isinstance(reply, ErrorMessage) else f"reply:{reply}"
        except PermissionError:
            outcome = "permission-denied"
        except Exception as err:  # noqa: BLE001 - report anything to the parent
            outcome = f"error:{err!r}"
        os.write(write_end, outcome.encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end) as pipe:
        return pipe.read()


@pytest.mark.skipif(os.geteuid() != 0, reason="changing uid needs root (CI runs as root)")
def test_peer_uid_outside_the_allow_list_is_refused(socket_dir: Path) -> None:
    os.chmod(socket_dir, 0o755)
    running = SidecarThread(sidecar_config(socket_dir / "run" / "m.sock",
                                           ingest={"allowed_uids": [0], "socket_mode": "0666", "dir_mode": "0755"})).start()
    try:
        assert _connect_as(65534, running.socket_path) == f"reply:{ErrorCode.PEER_REFUSED.value}"
        assert running.scrape().value("hicache_exporter_rejections_total", reason="peer_refused") == 1
        own = RawClient(running.socket_path)  # uid 0 is on the list
        own.send(hello())
        assert isinstance(own.recv(), Welcome)
    finally:
        running.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="changing uid needs root (CI runs as root)")
def test_socket_modes_keep_other_users_out(socket_dir: Path) -> None:
    os.chmod(socket_dir, 0o755)
    running = SidecarThread(sidecar_config(socket_dir / "run" / "m.sock")).start()  # 0660 in a 0750 directory
    try:
        assert _connect_as(65534, running.socket_path) == "permission-denied"
        assert running.scrape().value("hicache_exporter_connections_accepted_total") == 0
    finally:
        running.stop()


def test_total_series_guard(socket_dir: Path) -> None:
    # Rank and rollup series count together, and a new series needs room for its rollup too.
    running = SidecarThread(sidecar_config(socket_dir / "m.sock", ranks={"max_series_total": 8})).start()
    try:
        clients = []
        for tp in range(2):
            client = RawClient(running.socket_path)
            client.send(hello(tp=tp))
            assert isinstance(client.recv(), Welcome)
            client.send(snapshot(1, *(counter("hicache_dropped_tokens_total", 1, reason="host_pressure", pool=f"p{i}")
                                      for i in range(3))))
            clients.append(client)
        reply = clients[1].recv()
        assert isinstance(reply, ErrorMessage) and reply.code == "series_limit" and "max_series_total" in reply.message
        scrape = running.scrape()
        assert len(scrape.find("sglang_hicache_dropped_tokens_total")) == 4  # 3 of rank 0, 1 of rank 1
        assert len(scrape.find("sglang_rollup_hicache_dropped_tokens_total")) == 3
    finally:
        running.stop()


def test_rank_limit_forgets_expired_identities_first(socket_dir: Path) -> None:
    running = SidecarThread(sidecar_config(socket_dir / "m.sock", ranks={"max_ranks": 1, "stale_after_seconds": 0.2,
                                                                           "expire_after_seconds": 0.3})).start()
    try:
        first = RawClient(running.socket_path)
        first.send(hello(tp=0))
        assert isinstance(first.recv(), Welcome)
        second = RawClient(running.socket_path)
        second.send(hello(tp=1))
        reply = second.recv()
        assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.TOO_MANY_RANKS.value
        first.send(snapshot(1, counter("load_back_bytes_total", 10)))
        first.send({"type": "bye"})
        wait_until(lambda: running.scrape().value("hicache_exporter_ranks", state="expired") == 1)
        third = RawClient(running.socket_path)
        third.send(hello(tp=1))
        assert isinstance(third.recv(), Welcome)
        assert running.scrape().value("sglang_rollup_load_back_bytes_total") == 10  # the forgotten rank's share stays
    finally:
        running.stop()


def test_connection_dying_mid_frame_is_counted(sidecar: SidecarThread) -> None:
    client = RawClient(sidecar.socket_path)
    client.send(hello())
    assert isinstance(client.recv(), Welcome)
    client.send_raw(b"\x00\x00\x01\x00" + b"{" * 10)  # 256 bytes announced, 10 sent
    client.sock.shutdown(socket.SHUT_RDWR)
    client.close()
    wait_until(lambda: sidecar.scrape().value("hicache_exporter_rejections_total", reason="malformed_frame") == 1)


def _openssl(*args: str) -> None:
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to make test certificates"
    subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)


def _client_cert(tmp_path: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA of its own and a client certificate it signed: (ca, cert, key)."""
    ca, ca_key = tmp_path / f"{name}-ca.pem", tmp_path / f"{name}-ca.key"
    cert, key, csr = tmp_path / f"{name}.pem", tmp_path / f"{name}.key", tmp_path / f"{name}.csr"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
             "-subj", f"/CN={name} CA")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-out", str(cert), "-days", "1")
    return ca, cert, key


def _fetch(url: str, server_cert: Path, client: tuple[Path, Path] | None) -> int:
    context = ssl.create_default_context(cafile=str(server_cert))
    if client is not None:
        context.load_cert_chain(str(client[0]), str(client[1]))
    with urllib.request.urlopen(url, context=context, timeout=10) as resp:
        return resp.status


@pytest.mark.parametrize("policy, without_cert_ok", [(None, False), ("RequireAndVerifyClientCert", False),
                                                     ("VerifyClientCertIfGiven", True)])
def test_client_certificates_follow_client_auth_type(
    socket_dir: Path, tmp_path: Path, tls_files: tuple[Path, Path], policy: str | None, without_cert_ok: bool,
) -> None:
    cert, key = tls_files
    ca, client_cert, client_key = _client_cert(tmp_path, "prom")
    _, stranger_cert, stranger_key = _client_cert(tmp_path, "stranger")
    tls = {"cert_file": str(cert), "key_file": str(key), "client_ca_file": str(ca)}
    if policy is not None:
        tls["client_auth_type"] = policy
    running = SidecarThread(sidecar_config(socket_dir / "m.sock", http={"tls_server_config": tls})).start()
    try:
        assert running.sidecar is not None
        url = f"https://127.0.0.1:{running.sidecar.http_port}/-/healthy"
        assert _fetch(url, cert, (client_cert, client_key)) == 200
        with pytest.raises((OSError, http.client.HTTPException)):  # signed by a CA the sidecar does not trust
            _fetch(url, cert, (stranger_cert, stranger_key))
        if without_cert_ok:
            assert _fetch(url, cert, None) == 200
        else:
            with pytest.raises((OSError, http.client.HTTPException)):
                _fetch(url, cert, None)
    finally:
        running.stop()


@pytest.mark.parametrize("policy, ca, said", [
    ("RequestClientCert", True, "without verifying it"),
    ("RequireAnyClientCert", True, "without verifying it"),
    ("VerifyClientCertIfGiven", False, "needs client_ca_file"),
    ("NoClientCert", True, "client_ca_file is set but client_auth_type is NoClientCert"),
    ("Sometimes", True, "client_auth_type"),
])
def test_client_auth_types_that_cannot_hold_are_refused(tmp_path: Path, policy: str, ca: bool, said: str) -> None:
    tls = {"cert_file": "c.pem", "key_file": "k.pem", "client_auth_type": policy, **({"client_ca_file": "ca.pem"} if ca else {})}
    with pytest.raises(ConfigError, match=said):
        config_from_data({"http": {"tls_server_config": tls}}, "test")


def test_web_config_file_keeps_client_auth_type(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: c.pem\n  key_file: k.pem\n  client_ca_file: ca.pem\n"
                   "  client_auth_type: VerifyClientCertIfGiven\n")
    layer = web_config_layer(web)
    assert layer["tls_server_config"]["client_auth_type"] == "VerifyClientCertIfGiven"
    assert layer["tls_server_config"]["client_ca_file"] == str(tmp_path / "ca.pem")
    web.write_text("tls_server_config:\n  cert_file: c.pem\n  key_file: k.pem\n  client_auth_type: RequireClientCert\n")
    with pytest.raises(ConfigError, match="without verifying it"):
        apply_web_config(config_from_data({}, "test"), web)
