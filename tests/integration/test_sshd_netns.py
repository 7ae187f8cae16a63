"""The real-sshd and network-namespace fixtures (tests/support/sshd.py, testbed/netns.py) work.

Needs root, OpenSSH's server (``apt-get install -y openssh-server``) and iproute2.
"""

import os
import socket
import subprocess
import sys
import threading
import time

import paramiko
import pytest

from testbed.netns import etc_of, namespaces, shape
from tests.support.sshd import _descendants, sshd_server

pytestmark = pytest.mark.slow

# Small programs run inside namespaces (python -I -S starts in ~20 ms).
CONNECT = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    print("OK", s.recv(16).decode())
except OSError as e:
    print("FAIL", type(e).__name__, e)
"""
LISTEN = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(16)
print("ready", s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    if sys.argv[3] == "hello":
        c.sendall(b"hello")
    else:  # sink: read to EOF, then say how much
        n = 0
        while True:
            b = c.recv(1 << 16)
            if not b:
                break
            n += len(b)
        c.sendall(str(n).encode())
    c.close()
"""
SEND = """
import socket, sys, time
n = int(sys.argv[3])
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
t = time.monotonic()
s.sendall(b"x" * n)
s.shutdown(socket.SHUT_WR)
assert int(s.recv(32)) == n
print(time.monotonic() - t)
"""


def py(code, *args):
    return [sys.executable, "-I", "-S", "-c", code, *map(str, args)]


def alive(pid):
    """Running, or a zombie not yet reaped: either way still in /proc."""
    return os.path.exists(f"/proc/{pid}")


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def client(host, port, known_hosts, key_path, **kw):
    c = paramiko.SSHClient()
    c.load_host_keys(str(known_hosts))
    c.set_missing_host_key_policy(paramiko.RejectPolicy())
    c.connect(
        host,
        port=port,
        username="root",
        key_filename=str(key_path),
        look_for_keys=False,
        allow_agent=False,
        timeout=5,
        banner_timeout=5,
        auth_timeout=5,
        **kw,
    )
    return c


def run(c, command):
    _, out, err = c.exec_command(command, timeout=10)
    return out.channel.recv_exit_status(), out.read().decode(), err.read().decode()


def start_listener(prefix, host, port, mode="hello"):
    proc = subprocess.Popen([*prefix, *py(LISTEN, host, port, mode)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line and line[0] == "ready", line
    return proc, int(line[1])


def connect_from(prefix, host, port, timeout=1.0):
    out = subprocess.run([*prefix, *py(CONNECT, host, port, timeout)], capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or out.stderr


def test_exec_sftp_and_host_key_checking(tmp_path):
    with sshd_server(tmp_path) as server:
        assert server.user == "root" and server.port != 22
        assert server.known_hosts_line() == (f"[127.0.0.1]:{server.port} {server.host_public_key}")
        known_hosts = tmp_path / "known_hosts"
        known_hosts.write_text(server.known_hosts_line() + "\n")

        c = client(server.host, server.port, known_hosts, server.client_key_path)
        try:
            assert run(c, "echo ok") == (0, "ok\n", "")
            data = os.urandom(300_000)
            (tmp_path / "up.bin").write_bytes(data)
            sftp = c.open_sftp()
            remote = str(tmp_path / "remote.bin")
            sftp.put(str(tmp_path / "up.bin"), remote)
            assert sftp.stat(remote).st_size == len(data)
            sftp.get(remote, str(tmp_path / "down.bin"))
            sftp.close()
            assert (tmp_path / "down.bin").read_bytes() == data
        finally:
            c.close()

        # Unknown host key: RejectPolicy refuses.
        empty = tmp_path / "empty_known_hosts"
        empty.write_text("")
        with pytest.raises(paramiko.SSHException):
            client(server.host, server.port, empty, server.client_key_path)
        # Wrong host key for this [host]:port.
        wrong = tmp_path / "wrong_known_hosts"
        client_pub = " ".join((server.client_key_path.parent / "client_ed25519.pub").read_text().split()[:2])
        wrong.write_text(f"[{server.host}]:{server.port} {client_pub}\n")
        with pytest.raises(paramiko.BadHostKeyException):
            client(server.host, server.port, wrong, server.client_key_path)

        # The server's own helper works too, and the server still serves.
        with server.connect() as c2:
            assert run(c2, "echo again")[1] == "again\n"


def test_no_process_left_after_exit(tmp_path):
    with sshd_server(tmp_path) as server:
        c = server.connect()
        # A session still running, and a daemon that escaped into its own session.
        c.exec_command("sleep 60")
        assert run(c, "setsid nohup sleep 61 >/dev/null 2>&1 < /dev/null & echo started")[1] == "started\n"
        deadline = time.monotonic() + 5
        while True:
            tree = _descendants(server.process.pid)
            cmds = [cmdline(p) for p in tree]
            if b"sleep\x0060\x00" in cmds and b"sleep\x0061\x00" in cmds:
                break
            assert time.monotonic() < deadline, cmds
            time.sleep(0.02)
        pids = [server.process.pid, server.sshd_pid, *tree]
        assert server.sshd_pid in tree
        config = str(server.config_path)
    try:
        assert server.process.returncode is not None
        left = [p for p in pids if alive(p)]
        assert not left, left
        assert subprocess.run(["pgrep", "-f", config], capture_output=True).returncode == 1
        with pytest.raises(OSError):
            socket.create_connection((server.host, server.port), timeout=1).close()
    finally:
        c.close()


def test_namespaces_sshd_and_isolation(tmp_path):
    forward_before = open("/proc/sys/net/ipv4/ip_forward").read()
    with namespaces(["one", "two"]) as ns:
        one, two = ns["one"], ns["two"]
        assert list(ns) == ["one", "two"]
        assert one.exec_prefix() == ["ip", "netns", "exec", one.name]
        assert one.address != two.address and one.gateway != two.gateway
        names = [one.name, two.name]
        veths = [one.root_veth, two.root_veth]
        assert all(n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout for n in names)
        # no DNS server is reachable from a namespace: its resolv.conf names none
        resolv = one.run(["cat", "/etc/resolv.conf"], capture_output=True, text=True).stdout
        assert "testbed/netns.py" in resolv and "nameserver 127.0.0.1" in resolv

        # sshd inside namespace one, reached from the root namespace.
        with sshd_server(tmp_path, host=one.address, command_prefix=one.exec_prefix()) as s:
            with s.connect() as c:
                status, out, _ = run(c, "ip -4 -o addr show dev veth0; echo ok")
                assert status == 0 and one.address in out and out.endswith("ok\n")
            assert connect_from(two.exec_prefix(), one.address, s.port).startswith("FAIL")
            sshd_pids = [s.process.pid, *_descendants(s.process.pid)]
        assert not [p for p in sshd_pids if alive(p)]

        # A TCP server inside namespace one.
        server, port = start_listener(one.exec_prefix(), "0.0.0.0", 0)
        try:
            with socket.create_connection((one.address, port), timeout=2) as sock:
                assert sock.recv(5) == b"hello"  # from the root namespace
            assert connect_from(one.exec_prefix(), one.address, port) == "OK hello"
            assert connect_from(one.exec_prefix(), "127.0.0.1", port) == "OK hello"
            t = time.monotonic()
            result = connect_from(two.exec_prefix(), one.address, port)
            assert result.startswith("FAIL"), result
            assert time.monotonic() - t < 5
        finally:
            server.kill()
            server.wait()

        # A namespace reaches the root side of its own link.
        lsock = socket.create_server((one.gateway, 0))
        accepted = []
        threading.Thread(target=lambda: accepted.append(lsock.accept()[0].sendall(b"root!")), daemon=True).start()
        assert connect_from(one.exec_prefix(), one.gateway, lsock.getsockname()[1], 2) == "OK root!"
        lsock.close()

    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listing for n in names), listing
    assert not any(etc_of(n).exists() for n in names)
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    rules = subprocess.run(["ip", "rule", "list"], capture_output=True, text=True).stdout
    assert not any(v in links or v in rules for v in veths), (links, rules)
    assert open("/proc/sys/net/ipv4/ip_forward").read() == forward_before


def test_shape_limits_both_directions():
    with namespaces(["shaped"]) as ns:
        link = ns["shaped"]
        shape(link, 8)  # 8 Mbit/s = 1 MB/s
        root_q = subprocess.run(["tc", "qdisc", "show", "dev", link.root_veth], capture_output=True, text=True).stdout
        ns_q = link.run(["tc", "qdisc", "show", "dev", link.ns_veth], capture_output=True, text=True).stdout
        assert "tbf" in root_q and "8Mbit" in root_q, root_q
        assert "tbf" in ns_q and "8Mbit" in ns_q, ns_q

        n = 400_000  # 0.4 s at 1 MB/s; unshaped it takes a few ms
        # Into the namespace (root side's egress).
        sink, port = start_listener(link.exec_prefix(), link.address, 0, "sink")
        try:
            into = float(
                subprocess.run(py(SEND, link.address, port, n), capture_output=True, text=True, check=True).stdout
            )
        finally:
            sink.kill()
            sink.wait()
        # Out of the namespace (veth0's egress).
        sink, port = start_listener((), link.gateway, 0, "sink")
        try:
            out = float(link.run(py(SEND, link.gateway, port, n), capture_output=True, text=True, check=True).stdout)
        finally:
            sink.kill()
            sink.wait()
    print(f"400 kB at 8 Mbit/s: into {into:.3f} s, out {out:.3f} s")
    for elapsed in (into, out):
        assert 0.25 < elapsed < 5.0, (into, out)
