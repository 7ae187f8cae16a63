"""Network namespaces as stand-in hosts for tests and benchmarks.

    from testbed.netns import namespaces, shape

    with namespaces(["eu", "us"]) as ns:
        eu = ns["eu"]
        eu.address        # "10.200.7.2": the namespace's side of its link
        eu.gateway        # "10.200.7.1": the root namespace's side
        eu.exec_prefix()  # ["ip", "netns", "exec", eu.name]
        shape(eu, 100)    # 100 Mbit/s each way (tbf on both ends)

Each namespace is joined to the root namespace by its own veth pair (no bridge):
root side ``10.200.<i>.1/24``, namespace side ``10.200.<i>.2/24`` (device
``veth0``), loopback up, default route via the root side.  So the root namespace
reaches every namespace and every namespace reaches the root namespace (any of its
addresses), but namespaces do not reach one another: traffic one namespace sends
to another would have to be forwarded by the root namespace, and besides
``net.ipv4.ip_forward`` (this module never turns it on) a policy rule
``ip rule add pref 9000 iif <root veth> prohibit`` forbids forwarding anything
that comes in on our links, so isolation holds even where ip_forward is 1.  A
connection from one namespace to another fails at once with "No route to host"
(or times out if ICMP errors are rate limited).

No DNS server is reachable from a namespace, and a lookup would wait ~10 s for the
machine's before failing (moto's server looks its own address up as it starts): each
namespace gets a ``resolv.conf`` that points at none (``/etc/netns/<name>/resolv.conf``,
which ``ip netns exec`` bind-mounts over ``/etc/resolv.conf``), so lookups fail at once.

Names carry a per-run prefix (``dlc<pid>s<seq>-<name>``), the subnets are chosen
among those no address or route in the root namespace uses yet (under a lock
file, so parallel runs do not collide), and leftovers of dead runs are removed.
Needs root and iproute2 (``ip``, ``tc``).

A routed topology, for places that must reach one another over shaped links (testbed/wan.py)::

    from testbed.netns import routed_namespaces, shape_wan

    with routed_namespaces(["east", "west", "syncer"], rate_mbit=100,
                           rates={"syncer": 20}) as net:
        east = net["east"]        # a Place: a Namespace (its root link as above) and more
        east.wan_address          # "10.200.12.2": where other places (and root) reach it
        east.router_address       # "10.200.12.1": the router's side of east's link
        net.router                # the router's Namespace
        shape_wan(east, 50)       # change east's link: 50 Mbit/s each way

On top of :func:`namespaces` (one namespace per place plus one, ``router``, each with its
unshaped link to the root namespace), each place gets a second veth pair, ``wan0`` inside the
place to ``w<k>`` inside the router, on a subnet of its own (``10.200.<j>.0/24``: router side
``.1``, place side ``.2``).  Only the router forwards (``net.ipv4.ip_forward`` is set to 1 inside
it and to 0 inside each place; the root namespace's setting is not touched).  Each place routes
every other place's link subnet and the router's root-link subnet via the router; the root
namespace routes every place's link subnet via the router's root link.  So:

* place to place: place link, router, other place's link (two shaped links);
* root namespace to ``wan_address``: router's root link (unshaped), the place's link (shaped);
* root namespace to ``address``: the place's own root link, unshaped (for setting things up);
* place to another place's ``address``: refused, as between :func:`namespaces`.

Each place's link is shaped with tbf on both ends (the place's ``wan0`` and the router's
``w<k>``), at ``rates.get(label, rate_mbit)`` Mbit/s (None: unshaped).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

PREFIX = "dlc"
RULE_PREF = 9000
LOCK_PATH = "/run/diloco-netns.lock"
_seq = itertools.count()
_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
NETNS_ETC = Path("/etc/netns")
"""``ip netns exec NS`` bind-mounts each file of ``/etc/netns/NS/`` over the one in ``/etc/``."""
RESOLV_CONF = """# a test namespace (testbed/netns.py): no DNS server is reachable from here; fail at once
nameserver 127.0.0.1
options timeout:1 attempts:1
"""


@dataclass
class Namespace:
    label: str  # the name asked for
    name: str  # the real namespace name (unique per run)
    index: int  # the third octet of its subnet
    address: str  # namespace side of the link
    gateway: str  # root side of the link
    root_veth: str  # the link's device in the root namespace
    ns_veth: str = "veth0"  # the link's device inside the namespace
    prefixlen: int = 24

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def run(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run(argv) inside the namespace."""
        return subprocess.run([*self.exec_prefix(), *argv], **kwargs)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen([*self.exec_prefix(), *argv], **kwargs)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def ip_forward() -> bool:
    with open("/proc/sys/net/ipv4/ip_forward") as f:
        return f.read().strip() == "1"


def _pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _of_dead_run(name: str) -> bool:
    """Whether ``name`` (a namespace's or its /etc directory's) belongs to a run that has died."""
    m = re.match(rf"^{PREFIX}(\d+)s\d+-", name)
    return m is not None and not _pid_alive(int(m.group(1)))


def etc_of(name: str) -> Path:
    """The namespace's own files for ``/etc`` (its resolv.conf; testbed/wan.py adds hosts)."""
    return NETNS_ETC / name


def _remove_etc(name: str) -> None:
    shutil.rmtree(etc_of(name), ignore_errors=True)
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only when no other run has files there


def cleanup_stale() -> list[str]:
    """Remove namespaces, their /etc files and policy rules left behind by runs that have died."""
    removed = []
    for directory in NETNS_ETC.iterdir() if NETNS_ETC.is_dir() else ():
        if _of_dead_run(directory.name):
            _remove_etc(directory.name)
            removed.append(str(directory))
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if _of_dead_run(name):
            if _ip("netns", "delete", name, check=False).returncode == 0:
                removed.append(name)
    for line in _ip("rule", "list").stdout.splitlines():
        m = re.search(rf"\biif ({PREFIX}([0-9a-f]+)x[0-9a-f]+x[0-9a-f]+)\b", line)
        if m and line.startswith(f"{RULE_PREF}:") and not _pid_alive(int(m.group(2), 16)):
            _ip("rule", "del", "pref", str(RULE_PREF), "iif", m.group(1), check=False)
            removed.append(f"rule iif {m.group(1)}")
    return removed


def _used_indices() -> set[int]:
    text = _ip("-4", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    return {int(m) for m in re.findall(r"\b10\.200\.(\d+)\.", text)}


@contextlib.contextmanager
def namespaces(names: Sequence[str], subnet_index: int | None = None) -> Iterator[dict[str, Namespace]]:
    """Create one namespace per name; yield {name: Namespace} in the same order.

    ``subnet_index``: the third octet for the first namespace (the next ones count
    up from it); by default free ones are chosen.  Everything is removed on exit.
    """
    names = list(names)
    if len(set(names)) != len(names) or not all(_NAME_OK.match(n) for n in names):
        raise ValueError(f"namespace names must be distinct and [A-Za-z0-9_.-]: {names}")
    if os.geteuid() != 0:
        raise RuntimeError("network namespaces need root")
    pid, seq = os.getpid(), next(_seq) % 256
    created: list[Namespace] = []
    rules: list[str] = []
    try:
        with open(LOCK_PATH, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held while choosing and taking subnets
            cleanup_stale()
            used = _used_indices()
            if subnet_index is None:
                indices = [i for i in range(1, 255) if i not in used][: len(names)]
                if len(indices) < len(names):
                    raise RuntimeError("no free 10.200.<i>.0/24 subnets left")
            else:
                indices = list(range(subnet_index, subnet_index + len(names)))
                if not all(0 <= i <= 255 for i in indices) or used & set(indices):
                    raise RuntimeError(f"subnets 10.200.{indices}.0/24 invalid or in use")
            for k, (label, index) in enumerate(zip(names, indices)):
                ns = Namespace(
                    label=label,
                    name=f"{PREFIX}{pid}s{seq}-{label}",
                    index=index,
                    address=f"10.200.{index}.2",
                    gateway=f"10.200.{index}.1",
                    root_veth=f"{PREFIX}{pid:x}x{seq:x}x{k:x}",  # at most 15 characters
                )
                _ip("netns", "add", ns.name)
                created.append(ns)
                etc_of(ns.name).mkdir(parents=True, exist_ok=True)
                (etc_of(ns.name) / "resolv.conf").write_text(RESOLV_CONF)
                _ip("link", "add", ns.root_veth, "type", "veth", "peer", "name", ns.ns_veth, "netns", ns.name)
                _ip("addr", "add", f"{ns.gateway}/{ns.prefixlen}", "dev", ns.root_veth)
                _ip("link", "set", ns.root_veth, "up")
                _ip("rule", "add", "pref", str(RULE_PREF), "iif", ns.root_veth, "prohibit")
                rules.append(ns.root_veth)
                _ip("-n", ns.name, "link", "set", "lo", "up")
                _ip("-n", ns.name, "addr", "add", f"{ns.address}/{ns.prefixlen}", "dev", ns.ns_veth)
                _ip("-n", ns.name, "link", "set", ns.ns_veth, "up")
                _ip("-n", ns.name, "route", "add", "default", "via", ns.gateway)
        yield {ns.label: ns for ns in created}
    finally:
        for veth in rules:
            _ip("rule", "del", "pref", str(RULE_PREF), "iif", veth, "prohibit", check=False)
        with open(LOCK_PATH, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for ns in created:
                # Deleting the namespace destroys veth0 and with it the root side.
                _ip("netns", "delete", ns.name, check=False)
                _ip("link", "delete", ns.root_veth, check=False)
                _remove_etc(ns.name)


def _tbf(prefix: Sequence[str], dev: str, rate_mbit: float, burst_bytes: int, latency_ms: float) -> None:
    argv = [
        *prefix,
        "tc",
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{rate_mbit}mbit",
        "burst",
        str(burst_bytes),
        "latency",
        f"{latency_ms}ms",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")


def shape(link: Namespace, rate_mbit: float, *, burst_bytes: int | None = None, latency_ms: float = 50.0) -> None:
    """Limit the link to ``rate_mbit`` Mbit/s in each direction.

    tbf shapes egress only, so it goes on both ends: the root side (traffic into
    the namespace) and veth0 inside the namespace (traffic out of it).
    ``burst_bytes`` defaults to 10 ms worth of rate, at least 32 KiB.
    """
    if burst_bytes is None:
        burst_bytes = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 100))
    _tbf((), link.root_veth, rate_mbit, burst_bytes, latency_ms)
    _tbf(link.exec_prefix(), link.ns_veth, rate_mbit, burst_bytes, latency_ms)


def unshape(link: Namespace) -> None:
    for prefix, dev in (((), link.root_veth), (link.exec_prefix(), link.ns_veth)):
        subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)


ROUTER = "router"


@dataclass
class Place(Namespace):
    """A namespace of :func:`routed_namespaces`: its root link as any :class:`Namespace`, plus
    its link to the router."""

    wan_index: int = 0  # the third octet of the link's subnet
    wan_address: str = ""  # the place's side: where other places (and root) reach it
    router_address: str = ""  # the router's side
    router_name: str = ""  # the router's namespace
    router_veth: str = ""  # the link's device inside the router
    wan_veth: str = "wan0"  # the link's device inside the place

    def router_exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.router_name]


@dataclass
class RoutedNetwork:
    """What :func:`routed_namespaces` yields: ``net[label]`` is a :class:`Place`."""

    places: dict[str, Place]
    router: Namespace
    rates: dict[str, float | None] = field(default_factory=dict)  # Mbit/s per place, on entry

    def __getitem__(self, label: str) -> Place:
        return self.places[label]

    def __iter__(self) -> Iterator[str]:
        return iter(self.places)


def _sysctl(ns: Namespace, key: str, value: str) -> None:
    """Set ``key`` (e.g. ``net/ipv4/ip_forward``) inside ``ns``: /proc/sys/net is per namespace."""
    ns.run(["sh", "-c", f"echo {value} > /proc/sys/{key}"], check=True, capture_output=True)


def _take_wan_subnets(count: int, router: Namespace) -> list[int]:
    """Free subnet indices, taken (under the lock) by routing them via ``router`` in root."""
    with open(LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        used = _used_indices()
        indices = [i for i in range(1, 255) if i not in used][:count]
        if len(indices) < count:
            raise RuntimeError("no free 10.200.<i>.0/24 subnets left")
        for index in indices:
            _ip("route", "add", f"10.200.{index}.0/24", "via", router.address, "dev", router.root_veth)
    return indices


def _link_to_router(ns: Namespace, k: int, index: int, router: Namespace) -> Place:
    place = Place(
        **asdict(ns),
        wan_index=index,
        wan_address=f"10.200.{index}.2",
        router_address=f"10.200.{index}.1",
        router_name=router.name,
        router_veth=f"w{k}",
    )
    _ip(
        "-n",
        router.name,
        "link",
        "add",
        place.router_veth,
        "type",
        "veth",
        "peer",
        "name",
        place.wan_veth,
        "netns",
        place.name,
    )
    _ip("-n", router.name, "addr", "add", f"{place.router_address}/24", "dev", place.router_veth)
    _ip("-n", router.name, "link", "set", place.router_veth, "up")
    _ip("-n", place.name, "addr", "add", f"{place.wan_address}/24", "dev", place.wan_veth)
    _ip("-n", place.name, "link", "set", place.wan_veth, "up")
    _sysctl(place, "net/ipv4/ip_forward", "0")
    return place


def shape_wan(
    place: Place, rate_mbit: float | None, *, burst_bytes: int | None = None, latency_ms: float = 50.0
) -> None:
    """Limit ``place``'s link to the router to ``rate_mbit`` Mbit/s each way (None: no limit).

    As :func:`shape`: tbf on both ends, ``wan0`` in the place (traffic out of it) and
    ``w<k>`` in the router (traffic into it).
    """
    ends = ((place.exec_prefix(), place.wan_veth), (place.router_exec_prefix(), place.router_veth))
    if rate_mbit is None:
        for prefix, dev in ends:
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        return
    if burst_bytes is None:
        burst_bytes = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 100))
    for prefix, dev in ends:
        _tbf(prefix, dev, rate_mbit, burst_bytes, latency_ms)


@contextlib.contextmanager
def routed_namespaces(
    places: Sequence[str],
    rate_mbit: float | None = None,
    *,
    rates: Mapping[str, float | None] | None = None,
    burst_bytes: int | None = None,
    latency_ms: float = 50.0,
) -> Iterator[RoutedNetwork]:
    """One namespace per place and a router joining them (see the module's docstring).

    ``rate_mbit``: every place's link rate, unless ``rates`` names the place (None: unshaped).
    ``burst_bytes`` and ``latency_ms`` are tbf's, as for :func:`shape`.  Everything is removed
    on exit: the namespaces (and so the links inside them), the root links, and the root
    namespace's routes (they go with the router's root link).
    """
    places = list(places)
    if ROUTER in places:
        raise ValueError(f"{ROUTER!r} is the router's name, not a place's")
    rates = dict(rates or {})
    if unknown := set(rates) - set(places):
        raise ValueError(f"rates for places that are not there: {sorted(unknown)}")
    with namespaces([*places, ROUTER]) as ns:
        router = ns[ROUTER]
        _sysctl(router, "net/ipv4/ip_forward", "1")
        indices = _take_wan_subnets(len(places), router)
        linked = [_link_to_router(ns[label], k, index, router) for k, (label, index) in enumerate(zip(places, indices))]
        for place in linked:
            others = [f"10.200.{p.wan_index}.0/24" for p in linked if p is not place]
            for subnet in [*others, f"10.200.{router.index}.0/24"]:
                _ip("-n", place.name, "route", "add", subnet, "via", place.router_address)
        net = RoutedNetwork({p.label: p for p in linked}, router)
        for place in linked:
            net.rates[place.label] = rates.get(place.label, rate_mbit)
            shape_wan(place, net.rates[place.label], burst_bytes=burst_bytes, latency_ms=latency_ms)
        yield net
