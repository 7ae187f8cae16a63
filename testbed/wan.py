"""An emulated WAN for tests and benchmarks: regions with their own S3, far from one another.

    from testbed.wan import emulated_wan

    with emulated_wan(["east", "west"], extra_places=["syncer"], rate_mbit=100,
                      latency_ms=40, hostnames=True) as wan:
        east = wan.regions["east"]
        east.url           # "http://s3-east:9001": the same name everywhere (with hostnames=True)
        east.local_url     # "http://127.0.0.1:9000": moto itself, for clients inside east
        east.remote_url    # "http://10.200.12.2:9001": for clients elsewhere (delayed and shaped)
        east.setup_url     # "http://10.200.9.2:9000": from the root namespace, neither
        east.store("setup").create_bucket("ckpt")          # servers.ObjectStore for each URL
        wan.python("west", "import s3fs; ...", env=east.store("remote").env)  # in a place
        east.counters()    # the remote proxy's {"bytes_to_upstream", "bytes_to_client", "connections"}
        east.counters("local")  # the same for the in-region (zero-delay) proxy (hostnames=True)
        wan["syncer"].exec_prefix(), wan["syncer"].wan_address

Built on :func:`testbed.netns.routed_namespaces`: one namespace per region and extra place, each
linked to a router at ``rate_mbit`` (tbf on both ends; ``rates`` per place), so traffic between
places crosses two shaped links.  The kernel has no netem, so latency comes from a
:mod:`testbed.delay_proxy` per region: each region's namespace runs a moto S3 server on
``0.0.0.0:9000`` and, on ``<wan_address>:9001``, a proxy to it that delays data ``latency_ms`` each
way (a request/response round trip gains ``2 * latency_ms``) and counts the bytes it passes.  A
second proxy (``hostnames=True``), on ``127.0.0.1:9001`` inside the region, passes the region's own
traffic to moto without delay, only counting it.

One name per region, resolved per place (``hostnames=True``): a run's region has one endpoint URL, which its own
learners must reach directly and every other place through the delaying proxy.  So region R's
URL is ``http://s3-R:9001`` (``Region.url``), and every place gets its own hosts file,
``/etc/netns/<namespace>/hosts`` (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/*`` over
``/etc/``): inside R, ``s3-R`` is ``127.0.0.1`` (the zero-delay proxy); in every other place it
is R's ``wan_address`` (the delaying proxy).  The files also name every place's
``wan_address`` (``wan-<label>``), so that torch.distributed's reverse lookups of its peers
are answered here (other lookups fail at once: testbed.netns gives each namespace a
resolv.conf that points at no server).  The root namespace's ``/etc/hosts`` is not touched:
there, use ``setup_url`` or ``remote_url``.  The hosts files go with their namespaces.

What goes through what:

* ``url`` inside the region: loopback, the counting proxy, moto.
* ``url`` or ``remote_url`` from another place: that place's link, the router, the region's link,
  the delaying proxy.  ``remote_url`` from the root namespace also works: router's root link
  (unshaped), region's link, proxy.
* ``local_url`` (inside the region): moto directly, over loopback, counted by nothing.
* ``setup_url`` from the root namespace: the region's own root link to moto, for preparing and
  checking buckets without touching the counters or waiting on the WAN.

The proxies' counts are cumulative; :meth:`Region.counters` reads them as the proxy last wrote
them (every 0.1 s), by default waiting for a write newer than the call.  Every server, proxy,
hosts file and namespace is removed on exit, also when the body raises.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from testbed.netns import Namespace, Place, RoutedNetwork, etc_of, routed_namespaces
from testbed.servers import ObjectStore, stop_process

MOTO_PORT = 9000
PROXY_PORT = 9001
REPO_ROOT = Path(__file__).resolve().parents[1]
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""What an S3 client (boto3, s3fs) needs in its environment to talk to these moto servers."""
_STARTUP_TIMEOUT_S = 30.0


@dataclass
class Region:
    """A region: a place with its own S3 server and a delay proxy in front of it."""

    name: str
    place: Place
    latency_ms: float  # one-way delay added by the remote proxy
    local_url: str
    remote_url: str
    setup_url: str
    stats_path: Path  # the remote (delaying) proxy's counts
    local_stats_path: Path  # the in-region (zero-delay) proxy's counts

    @property
    def hostname(self) -> str:
        """The region's S3 endpoint name, resolved per place (see the module's docstring)."""
        return region_hostname(self.name)

    @property
    def url(self) -> str:
        """``http://s3-<name>:9001``: direct inside the region, delayed from anywhere else."""
        return f"http://{self.hostname}:{PROXY_PORT}"

    def store(self, kind: str = "remote") -> ObjectStore:
        """A :class:`testbed.servers.ObjectStore` for ``kind`` "local", "remote", "setup" or
        "named" (``url``: usable inside the places only)."""
        url = {"local": self.local_url, "remote": self.remote_url, "setup": self.setup_url, "named": self.url}[kind]
        storage_options = {"endpoint_url": url, "key": "testing", "secret": "testing"}
        return ObjectStore("s3", url, storage_options, {**S3_ENV, "AWS_ENDPOINT_URL": url})

    def counters(self, kind: str = "remote", fresh: bool = True, timeout_s: float = 5.0) -> dict[str, int]:
        """The counts of the ``kind`` proxy, "remote" (the delaying one other places go
        through) or "local" (the region's own traffic); ``fresh``: as written after this call
        (so they include all that the proxy had read when it was made)."""
        path = {"remote": self.stats_path, "local": self.local_stats_path}[kind]
        called = time.time()
        deadline = time.monotonic() + timeout_s
        while fresh and path.stat().st_mtime <= called:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}'s {kind} proxy has not written {path} for {timeout_s}s")
            time.sleep(0.02)
        return json.loads(path.read_text())


@dataclass
class Wan:
    """What :func:`emulated_wan` yields; ``wan[label]`` is a place (region or extra)."""

    net: RoutedNetwork
    regions: dict[str, Region]
    hosts_files: dict[str, Path]  # per place label: its /etc/netns/<ns>/hosts

    def __getitem__(self, label: str) -> Place:
        return self.net[label]

    @property
    def places(self) -> dict[str, Place]:
        return self.net.places

    @property
    def router(self) -> Namespace:
        return self.net.router

    def address(self, label: str) -> str:
        """Where other places reach place ``label``."""
        return self.net[label].wan_address

    def python(
        self, label: str, code: str, *args: object, env: Mapping[str, str] | None = None, timeout: float = 60.0
    ) -> str:
        """Run ``python -c code args`` (this interpreter) inside place ``label``, with
        :data:`S3_ENV` and ``env`` on top of ours; return its stdout, raise if it fails."""
        argv = [*self.net[label].exec_prefix(), sys.executable, "-c", code, *map(str, args)]
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO_ROOT,
            env={**os.environ, **S3_ENV, **(env or {})},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"python in {label} exited with {proc.returncode}:\n{proc.stderr}")
        return proc.stdout


def region_hostname(region: str) -> str:
    """The name of region ``region``'s S3 endpoint (``s3-<region>``)."""
    return f"s3-{region}"


def hosts_text(place: str, addresses: Mapping[str, str], base: str, places: Mapping[str, str] | None = None) -> str:
    """``base`` (this machine's /etc/hosts) plus a line per region: ``127.0.0.1`` for the
    place's own region, the region's ``addresses[region]`` (its wan address) for the others;
    and a name (``wan-<label>``) for each of ``places``' wan addresses, so that reverse lookups
    of peers (torch.distributed makes them) are answered here instead of timing out on a DNS
    server a namespace cannot reach."""
    lines = [base.rstrip("\n"), "# emulated WAN (testbed/wan.py): the regions' S3 endpoints as seen from here"]
    for region, address in addresses.items():
        lines.append(f"{'127.0.0.1' if region == place else address} {region_hostname(region)}")
    lines += [f"{address} wan-{label}" for label, address in (places or {}).items()]
    return "\n".join(lines) + "\n"


def write_hosts_files(net: RoutedNetwork, regions: Sequence[str]) -> dict[str, Path]:
    """A hosts file per place resolving every region's endpoint name, beside the
    namespace's resolv.conf (testbed.netns removes both with the namespace)."""
    base = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
    addresses = {region: net[region].wan_address for region in regions}
    places = {label: place.wan_address for label, place in net.places.items()}
    files = {}
    for label, place in net.places.items():
        files[label] = etc_of(place.name) / "hosts"
        files[label].write_text(hosts_text(label, addresses, base, places))
    return files


def _start(stack: contextlib.ExitStack, argv: list[str], log: IO[bytes]) -> subprocess.Popen:
    """Start ``argv``, logging to ``log``; it is stopped when ``stack`` closes."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO_ROOT)
    stack.callback(stop_process, proc)
    return proc


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # it answered, so it is serving
    except OSError:
        return False


def _wait_ready(proc: subprocess.Popen, log: IO[bytes], ready) -> None:
    """Wait until ``ready()``; raise with the log if ``proc`` exits or it takes too long."""
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while not ready():
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log.read().decode(errors='replace')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.args} not ready after {_STARTUP_TIMEOUT_S}s")
        time.sleep(0.02)


@contextlib.contextmanager
def emulated_wan(
    regions: Sequence[str] = ("east", "west"),
    extra_places: Sequence[str] = ("syncer",),
    rate_mbit: float | None = 100.0,
    latency_ms: float = 40.0,
    *,
    rates: Mapping[str, float | None] | None = None,
    latencies: Mapping[str, float] | None = None,
    hostnames: bool = False,
) -> Iterator[Wan]:
    """Regions with S3 and extra places, joined by shaped links; see the module's docstring.

    ``rate_mbit``: each place's link rate (None: unshaped), ``rates``: per place instead.
    ``latency_ms``: the one-way delay of each region's proxy, ``latencies``: per region instead.
    ``hostnames``: give every place its hosts file resolving ``s3-<region>`` and run each
    region's in-region zero-delay proxy on ``127.0.0.1:9001`` (what ``Region.url`` needs);
    without it only moto and the delaying proxy run in a region.
    """
    regions, latencies = list(regions), dict(latencies or {})
    if unknown := set(latencies) - set(regions):
        raise ValueError(f"latencies for regions that are not there: {sorted(unknown)}")
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(routed_namespaces([*regions, *extra_places], rate_mbit, rates=rates))
        hosts_files = write_hosts_files(net, regions) if hostnames else {}
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wan-")))
        starting = []
        for name in regions:
            place = net[name]
            delay = latencies.get(name, latency_ms)
            moto_log = stack.enter_context(open(tmp / f"{name}-moto.log", "w+b"))
            moto = _start(
                stack,
                [*place.exec_prefix(), sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", str(MOTO_PORT)],
                moto_log,
            )
            region = Region(
                name=name,
                place=place,
                latency_ms=delay,
                local_url=f"http://127.0.0.1:{MOTO_PORT}",
                remote_url=f"http://{place.wan_address}:{PROXY_PORT}",
                setup_url=f"http://{place.address}:{MOTO_PORT}",
                stats_path=tmp / f"{name}-proxy.json",
                local_stats_path=tmp / f"{name}-local-proxy.json",
            )
            proxies = []
            listeners = [(place.wan_address, delay, region.stats_path, "proxy")]  # other places: delayed
            if hostnames:  # the region itself, by name: counted, not delayed
                listeners.append(("127.0.0.1", 0.0, region.local_stats_path, "local-proxy"))
            for listen, proxy_delay, stats, kind in listeners:
                proxy_log = stack.enter_context(open(tmp / f"{name}-{kind}.log", "w+b"))
                proxies.append(
                    (
                        _start(
                            stack,
                            [
                                *place.exec_prefix(),
                                sys.executable,
                                "-m",
                                "testbed.delay_proxy",
                                "--listen",
                                f"{listen}:{PROXY_PORT}",
                                "--upstream",
                                f"127.0.0.1:{MOTO_PORT}",
                                "--delay-ms",
                                str(proxy_delay),
                                "--stats",
                                str(stats),
                            ],
                            proxy_log,
                        ),
                        proxy_log,
                        stats,
                    )
                )
            starting.append((region, moto, moto_log, proxies))
        for region, moto, moto_log, proxies in starting:  # all start at once: ~1 s in all
            _wait_ready(moto, moto_log, lambda region=region: _answers(f"{region.setup_url}/moto-api/"))
            for proxy, proxy_log, stats in proxies:
                _wait_ready(proxy, proxy_log, stats.exists)
        yield Wan(net, {region.name: region for region, *_ in starting}, hosts_files)
