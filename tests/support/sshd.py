"""A real OpenSSH server for tests.

    from tests.support.sshd import sshd_server

    with sshd_server(tmp_path) as server:                       # root namespace
        client = server.connect()                               # paramiko SSHClient
    with sshd_server(tmp_path, host=ns.address,
                     command_prefix=ns.exec_prefix()) as server: # inside a namespace
        ...

Each server gets its own ed25519 host key, its own ed25519 client key pair and its
own config (key-only login as root, sftp through ``internal-sftp``) in a fresh
directory under ``tmp_dir``.

sshd is not started directly: it runs under a small supervisor (this file, run as
a script) that makes itself a *child subreaper*.  sshd detaches each connection
into its own session (``setsid``), so killing sshd or its process group leaves
connections and the commands they run behind; under the supervisor every process
that sshd ever starts, even orphaned or daemonised ones, stays in the
supervisor's subtree, and on exit the supervisor kills that whole subtree and
reaps it.  The supervisor also dies with the process that started it
(``PR_SET_PDEATHSIG``), so a killed test run leaves no sshd behind; note that
"the process" is, to Linux, the *thread* that entered ``sshd_server``, so keep the
server in a thread that outlives its use (pytest's main thread does).

Needs root (sshd runs as root, logins are as root) and ``/usr/sbin/sshd``
(``apt-get install -y openssh-server``).  This module imports only the standard
library at the top, because it is also run as the supervisor script.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
INSTALL_HINT = "apt-get install -y openssh-server"

_READY = re.compile(r"Server listening on \S+ port (\d+)")
_BIND_FAILED = ("Address already in use", "Cannot bind any address")


class SshdUnavailable(RuntimeError):
    """OpenSSH's server or key generator is missing, or we cannot run it."""


@dataclass
class SshdServer:
    host: str
    port: int
    user: str
    client_key_path: Path
    host_public_key: str  # "ssh-ed25519 AAAA..." (key type and base64, no comment)
    known_hosts_path: Path  # a known_hosts file holding known_hosts_line()
    config_path: Path
    log_path: Path  # sshd's stderr (-e)
    process: subprocess.Popen  # the supervisor; sshd is its only direct child
    sshd_pid: int
    directory: Path
    startup_s: float = field(default=0.0)

    def known_hosts_line(self) -> str:
        """``[host]:port keytype base64`` (plain ``host`` for port 22)."""
        return f"{_known_hosts_name(self.host, self.port)} {self.host_public_key}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def connect(self, timeout: float = 10.0):
        """A paramiko SSHClient, logged in, that checks the host key (RejectPolicy)."""
        import paramiko

        client = paramiko.SSHClient()
        client.load_host_keys(str(self.known_hosts_path))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        client.connect(
            self.host,
            port=self.port,
            username=self.user,
            key_filename=str(self.client_key_path),
            look_for_keys=False,
            allow_agent=False,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
        )
        return client


def _known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def _require_tools() -> None:
    missing = [p for p in (SSHD,) if not os.access(p, os.X_OK)]
    if not shutil.which("ssh-keygen"):
        missing.append("ssh-keygen")
    if missing:
        raise SshdUnavailable(
            f"{', '.join(missing)} not found: these tests run a real OpenSSH server; install it with `{INSTALL_HINT}`"
        )
    if os.geteuid() != 0:
        raise SshdUnavailable("sshd_server needs root (sshd runs as root and logins are as root)")
    try:
        with open("/etc/shadow") as f:
            for line in f:
                if line.startswith("root:") and line.split(":")[1].startswith("!"):
                    raise SshdUnavailable(
                        "root's password is locked ('!' in /etc/shadow); with UsePAM no, "
                        "sshd refuses even key logins to a locked account. Unlock it "
                        "without a password, e.g. `usermod -p '*' root`"
                    )
    except OSError:
        pass


_version_cache: tuple[int, int] | None = None


def sshd_version() -> tuple[int, int]:
    global _version_cache
    if _version_cache is None:
        out = subprocess.run([SSHD, "-V"], capture_output=True, text=True).stderr
        m = re.search(r"OpenSSH_(\d+)\.(\d+)", out)
        _version_cache = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    return _version_cache


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
    )


def _pick_port(host: str, in_other_namespace: bool) -> int:
    if not in_other_namespace:
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                return s.getsockname()[1]
        except OSError:
            pass
    # Another namespace has its own port space, which we cannot probe from here;
    # a clash makes sshd exit at once, and we then retry with another port.
    return random.randint(20000, 60999)


def _config(directory: Path, host: str, port: int, extra: Sequence[str]) -> str:
    lines = [
        f"Port {port}",
        f"ListenAddress {host}",
        f"HostKey {directory / 'host_ed25519'}",
        f"PidFile {directory / 'sshd.pid'}",
        f"AuthorizedKeysFile {directory / 'authorized_keys'}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "HostbasedAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PermitRootLogin prohibit-password",
        "Subsystem sftp internal-sftp",
        "UseDNS no",
        "PrintMotd no",
        "PrintLastLog no",
        "X11Forwarding no",
        # Many learners may connect at once from the same address.
        "MaxStartups 200",
        "MaxSessions 100",
        "LogLevel INFO",
    ]
    if sshd_version() >= (9, 8):
        # Newer sshd penalises addresses whose connections never log in (like a
        # client that rejects the host key); tests do that on purpose.
        lines.append("PerSourcePenalties no")
    lines.extend(extra)
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def sshd_server(
    tmp_dir,
    host: str = "127.0.0.1",
    command_prefix: Sequence[str] = (),
    *,
    extra_config: Sequence[str] = (),
    start_timeout: float = 10.0,
) -> Iterator[SshdServer]:
    """Run ``/usr/sbin/sshd -D -e -f CONFIG`` on ``host`` at a free port.

    ``command_prefix`` is put in front of the command, e.g.
    ``["ip", "netns", "exec", "ns1"]`` to run it inside a network namespace (then
    ``host`` should be an address of that namespace).  ``extra_config`` lines are
    appended to sshd_config.  Yields an :class:`SshdServer`; on exit sshd, every
    connection and everything they started are killed and reaped.
    """
    _require_tools()
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir
    started = time.monotonic()
    directory = Path(tempfile.mkdtemp(prefix="sshd-", dir=str(tmp_dir)))
    _keygen(directory / "host_ed25519", "diloco-test-host")
    _keygen(directory / "client_ed25519", "diloco-test-client")
    (directory / "authorized_keys").write_text((directory / "client_ed25519.pub").read_text())
    keytype, b64 = (directory / "host_ed25519.pub").read_text().split()[:2]
    host_public_key = f"{keytype} {b64}"
    config_path = directory / "sshd_config"
    log_path = directory / "sshd.log"

    proc = None
    port = 0
    for _attempt in range(8):
        port = _pick_port(host, bool(command_prefix))
        config_path.write_text(_config(directory, host, port, extra_config))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    *command_prefix,
                    sys.executable,
                    "-I",
                    "-S",
                    os.path.abspath(__file__),
                    "--supervise",
                    str(os.getpid()),
                    SSHD,
                    "-D",
                    "-e",
                    "-f",
                    str(config_path),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        state = _wait_ready(proc, log_path, start_timeout)
        if state == "ready":
            break
        _stop(proc)
        if state != "bind":
            raise RuntimeError(
                f"sshd did not start ({state}); command prefix {list(command_prefix)}; "
                f"log:\n{log_path.read_text(errors='replace')}"
            )
    else:
        raise RuntimeError(f"sshd could not bind a port on {host}:\n{log_path.read_text()}")

    try:
        sshd_pid = _only_child(proc.pid)
        server = SshdServer(
            host=host,
            port=port,
            user="root",
            client_key_path=directory / "client_ed25519",
            host_public_key=host_public_key,
            known_hosts_path=directory / "known_hosts",
            config_path=config_path,
            log_path=log_path,
            process=proc,
            sshd_pid=sshd_pid,
            directory=directory,
            startup_s=time.monotonic() - started,
        )
        server.known_hosts_path.write_text(server.known_hosts_line() + "\n")
        yield server
    finally:
        _stop(proc)


def _wait_ready(proc: subprocess.Popen, log_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        text = log_path.read_text(errors="replace")
        if _READY.search(text):
            return "ready"
        if proc.poll() is not None:
            text = log_path.read_text(errors="replace")
            if _READY.search(text):
                return f"exited with {proc.returncode} right after starting"
            if any(s in text for s in _BIND_FAILED):
                return "bind"
            return f"exited with {proc.returncode}"
        if time.monotonic() > deadline:
            return f"not listening after {timeout} s"
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _only_child(pid: int) -> int:
    kids = [p for p, pp in _ppids().items() if pp == pid]
    return kids[0] if kids else -1


def _stop(proc: subprocess.Popen) -> None:
    """Ask the supervisor to kill and reap everything; force it if it does not."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            pass
        # Should not happen: kill the supervisor's tree from here.
        for pid in [proc.pid, *_descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


# --- process tree, shared with the supervisor -------------------------------


def _ppids() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ..."; comm may hold spaces and parentheses.
        fields = stat[stat.rindex(b")") + 2 :].split()
        out[int(entry)] = int(fields[1])
    return out


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in _ppids().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for kid in children.get(todo.pop(), ()):
            found.append(kid)
            todo.append(kid)
    return found


def _supervise(parent: int, argv: list[str]) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if not os.path.exists(f"/proc/{parent}"):  # the starter died before PDEATHSIG was set
        return 1

    def kill_all() -> None:
        me = os.getpid()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            # A process killed here cannot fork any more; one forked just before
            # is reparented to us (subreaper) and is found on the next pass.
            for pid in _descendants(me):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            while True:
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return  # nothing left
                if pid == 0:
                    break
            time.sleep(0.002)

    def on_term(signum, frame):
        kill_all()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    while True:  # reap orphans until sshd itself exits
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            kill_all()
            return os.waitstatus_to_exitcode(status) & 0xFF


if __name__ == "__main__" and len(sys.argv) > 3 and sys.argv[1] == "--supervise":
    sys.exit(_supervise(int(sys.argv[2]), sys.argv[3:]))
