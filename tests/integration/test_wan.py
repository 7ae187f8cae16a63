"""The emulated WAN (testbed/wan.py, testbed/netns.py's routed topology, testbed/delay_proxy.py) does
what benchmarks rely on: shaped links limit throughput, the proxy adds its latency and counts
bytes truly, and S3 clients work through it.

Needs root and iproute2.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from testbed.delay_proxy import delay_proxy
from testbed.netns import routed_namespaces, shape_wan
from testbed.wan import emulated_wan

pytestmark = pytest.mark.slow

RATE_MBIT = 8.0  # 1 MB/s
LATENCY_MS = 50.0

# Small programs run inside namespaces (python -I -S starts in ~20 ms).
SINK = """
import socket, sys
s = socket.create_server(("0.0.0.0", 0))
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
n = 0
while (b := c.recv(1 << 16)):
    n += len(b)
c.sendall(str(n).encode())
"""
SEND = """
import socket, sys, time
n = int(sys.argv[3])
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
t = time.monotonic()
s.sendall(b"x" * n)
s.shutdown(socket.SHUT_WR)
assert int(s.recv(32)) == n
print(time.monotonic() - t)
"""
ROUND_TRIPS = """
import sys, time, urllib.request
times = []
for _ in range(int(sys.argv[2])):
    t = time.monotonic()
    urllib.request.urlopen(sys.argv[1] + "/", timeout=30).read()
    times.append(time.monotonic() - t)
print(min(times))
"""
PUT = """
import sys, time, urllib.request
# (urllib's default Content-Type is a form's: moto would take the body for form fields.)
request = urllib.request.Request(sys.argv[1], data=b"y" * int(sys.argv[2]), method="PUT",
                                 headers={"Content-Type": "application/octet-stream"})
t = time.monotonic()
urllib.request.urlopen(request, timeout=30).read()
print(time.monotonic() - t)
"""
S3FS = """
import sys, s3fs
fs = s3fs.S3FileSystem(endpoint_url=sys.argv[1], key="testing", secret="testing",
                       use_listings_cache=False, skip_instance_cache=True)
fs.mkdir("fromwest")
fs.pipe("fromwest/a/b.bin", bytes(range(256)) * 1000)
assert fs.cat("fromwest/a/b.bin") == bytes(range(256)) * 1000
print(sorted(fs.ls("fromwest/a")))
"""


def py(code: str, *args: object) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", code, *map(str, args)]


@pytest.fixture(scope="module")
def wan():
    with emulated_wan(["east", "west"], extra_places=["syncer"], rate_mbit=RATE_MBIT, latency_ms=LATENCY_MS) as wan:
        yield wan


def transfer_seconds(sender, receiver, address: str, n: int) -> float:
    """Send ``n`` bytes from place ``sender`` to a sink in place ``receiver`` at ``address``."""
    sink = subprocess.Popen([*receiver.exec_prefix(), *py(SINK)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(sink.stdout.readline())
        out = subprocess.run(
            [*sender.exec_prefix(), *py(SEND, address, port, n)], capture_output=True, text=True, check=True, timeout=60
        ).stdout
        return float(out)
    finally:
        sink.kill()
        sink.wait()


def test_shaped_links_limit_throughput(wan):
    n = 2_000_000  # 2 s at 8 Mbit/s; unshaped a few ms
    syncer, east = wan["syncer"], wan["east"]
    for sender, receiver in ((syncer, east), (east, syncer)):
        seconds = transfer_seconds(sender, receiver, receiver.wan_address, n)
        mbit = n * 8 / seconds / 1e6
        print(f"{sender.label} -> {receiver.label}: 2 MB in {seconds:.2f} s = {mbit:.2f} Mbit/s")
        assert 0.5 * RATE_MBIT <= mbit <= 1.15 * RATE_MBIT, (sender.label, mbit)
    for place in (syncer, east):  # tbf on both ends of each link
        ends = [(place.exec_prefix(), place.wan_veth), (place.router_exec_prefix(), place.router_veth)]
        for prefix, dev in ends:
            qdisc = subprocess.run(
                [*prefix, "tc", "qdisc", "show", "dev", dev], capture_output=True, text=True, check=True
            ).stdout
            assert "tbf" in qdisc and "8Mbit" in qdisc, qdisc


def test_places_reach_each_other_only_through_the_router(wan):
    east, west = wan["east"], wan["west"]
    connect = "import socket, sys; socket.create_connection((sys.argv[1], 9000), timeout=1); print('OK')"
    assert wan.python("west", connect, east.wan_address).strip() == "OK"
    with pytest.raises(RuntimeError, match="TimeoutError|OSError|unreachable|No route"):
        wan.python("west", connect, east.address)  # east's root link: not from another place
    socket.create_connection((east.address, 9000), timeout=1).close()  # but from root, yes
    socket.create_connection((east.wan_address, 9000), timeout=1).close()  # and via the router
    for place in (east, west):
        forward = place.run(["cat", "/proc/sys/net/ipv4/ip_forward"], capture_output=True, text=True)
        assert forward.stdout.strip() == "0"
    assert (
        wan.router.run(["cat", "/proc/sys/net/ipv4/ip_forward"], capture_output=True, text=True).stdout.strip() == "1"
    )


def test_proxy_adds_latency(wan):
    east = wan.regions["east"]
    through_proxy = float(wan.python("syncer", ROUND_TRIPS, east.remote_url, 5))
    direct = float(wan.python("syncer", ROUND_TRIPS, f"http://{east.place.wan_address}:9000", 5))
    print(
        f"S3 list-buckets from syncer: {through_proxy * 1000:.1f} ms through the proxy, "
        f"{direct * 1000:.1f} ms to moto over the same links"
    )
    assert through_proxy >= 2 * LATENCY_MS / 1000
    assert through_proxy < 2 * LATENCY_MS / 1000 + 0.5
    assert direct < LATENCY_MS / 1000  # the latency is the proxy's, not the links'


def test_proxy_counts_the_bytes_it_passes(wan):
    east = wan.regions["east"]
    east.store("setup").create_bucket("counted")  # root link: not through the proxy
    n = 500_000
    before = east.counters()
    seconds = float(wan.python("west", PUT, f"{east.remote_url}/counted/blob", n))
    after = east.counters()
    up = after["bytes_to_upstream"] - before["bytes_to_upstream"]
    down = after["bytes_to_client"] - before["bytes_to_client"]
    print(
        f"PUT of {n} bytes west -> east: {seconds:.2f} s ({n * 8 / seconds / 1e6:.2f} Mbit/s), "
        f"{up} bytes up, {down} down"
    )
    assert n <= up <= n + 4096
    assert 0 < down <= 4096
    assert after["connections"] - before["connections"] == 1
    assert east.store("setup").filesystem().size("counted/blob") == n
    assert seconds >= n * 8 / (1.15 * RATE_MBIT * 1e6) + 2 * LATENCY_MS / 1000


def test_s3fs_through_the_remote_endpoint(wan):
    east = wan.regions["east"]
    listing = wan.python("west", S3FS, east.remote_url, timeout=120)
    assert "fromwest/a/b.bin" in listing
    data = bytes(range(256)) * 1000
    # The same object, from inside east (local URL), from the root namespace through the
    # router and from the root namespace's direct link.
    local = wan.python(
        "east",
        "import s3fs, sys; fs = s3fs.S3FileSystem(endpoint_url=sys.argv[1]);print(fs.size('fromwest/a/b.bin'))",
        east.local_url,
    )
    assert int(local) == len(data)
    assert east.store("remote").filesystem().cat("fromwest/a/b.bin") == data
    assert east.store("setup").filesystem().cat("fromwest/a/b.bin") == data
    # West's own S3 is a different server.
    assert not wan.regions["west"].store("setup").filesystem().exists("fromwest")


def test_delay_proxy_in_process_keeps_order_and_counts():
    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = server.accept()
        while data := conn.recv(1 << 16):
            conn.sendall(data)
        conn.close()

    threading.Thread(target=echo, daemon=True).start()
    payload = os.urandom(3_000_000)
    with delay_proxy(server.getsockname(), delay_s=0.03) as proxy:
        with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
            start = time.monotonic()
            sock.sendall(b"ping")
            assert sock.recv(4) == b"ping"
            assert time.monotonic() - start >= 0.06
            threading.Thread(target=lambda: (sock.sendall(payload), sock.shutdown(socket.SHUT_WR)), daemon=True).start()
            received = bytearray()
            while data := sock.recv(1 << 16):
                received += data
        assert bytes(received) == payload
        assert proxy.counts.as_dict() == {
            "bytes_to_upstream": len(payload) + 4,
            "bytes_to_client": len(payload) + 4,
            "connections": 1,
        }
    server.close()


def test_everything_stops_when_the_body_raises():
    with pytest.raises(KeyError):
        with emulated_wan(["solo"], extra_places=[], rate_mbit=None, latency_ms=1) as wan:
            names = [wan["solo"].name, wan.router.name]
            pids = subprocess.run(
                ["ip", "netns", "pids", names[0]], capture_output=True, text=True, check=True
            ).stdout.split()
            assert len(pids) == 2  # moto and the proxy
            stats = wan.regions["solo"].stats_path
            raise KeyError("boom")
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listing for name in names), listing
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    assert not stats.exists()


def test_per_place_rates_and_reshaping():
    def qdisc(prefix: list[str], dev: str) -> str:
        return subprocess.run(
            [*prefix, "tc", "qdisc", "show", "dev", dev], capture_output=True, text=True, check=True
        ).stdout

    with routed_namespaces(["a", "b", "c"], 8, rates={"b": 4, "c": None}) as net:
        assert net.rates == {"a": 8, "b": 4, "c": None}
        for label, shown in (("a", "8Mbit"), ("b", "4Mbit")):
            place = net[label]
            assert shown in qdisc(place.exec_prefix(), place.wan_veth)
            assert shown in qdisc(place.router_exec_prefix(), place.router_veth)
        c = net["c"]
        assert "tbf" not in qdisc(c.exec_prefix(), c.wan_veth)
        shape_wan(c, 2)
        assert "2Mbit" in qdisc(c.exec_prefix(), c.wan_veth)
        assert "2Mbit" in qdisc(c.router_exec_prefix(), c.router_veth)
        shape_wan(c, None)
        assert "tbf" not in qdisc(c.router_exec_prefix(), c.router_veth)
    with pytest.raises(ValueError):
        with routed_namespaces(["router"]):
            pass
