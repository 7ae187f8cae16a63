"""SSH to the hosts of a run, with paramiko, host keys verified like OpenSSH does.

A host's key must already be in known_hosts.  An unknown key is refused with its exact
fingerprint and the way to accept it (``--accept-new-host-keys``, OpenSSH's
``accept-new``: unknown keys are added, known ones still checked); a changed key is
always refused.  Connections time out, and the error names the host.
"""

from __future__ import annotations

import logging
import shlex
import stat
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import paramiko

from diloco_cli.config.errors import ConfigError

logging.getLogger("paramiko").addHandler(logging.NullHandler())
"""paramiko's transport thread logs a failed handshake (a port that answers no SSH) with
two tracebacks, which Python prints on stderr when nothing else takes them; the error
:func:`connect` raises says it in one line."""


class SSHError(ConfigError):
    """A host cannot be used over SSH; the message names it and says what to do."""


@dataclass(frozen=True)
class SSHTarget:
    """How to reach one host."""

    name: str
    address: str
    port: int = 22
    user: str | None = None
    key_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    connect_timeout: float = 10.0

    @property
    def where(self) -> str:
        return f"{self.user + '@' if self.user else ''}{self.address}:{self.port}"


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    def __init__(self, target: SSHTarget, accept_new: bool) -> None:
        self.target = target
        self.accept_new = accept_new

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.accept_new:
            raise SSHError(
                f"host {self.target.name} ({self.target.where}) offered an unknown {key.get_name()} key "
                f"{key.fingerprint}; "
                f"if that is its key, run again with --accept-new-host-keys (adds it to {self.target.known_hosts}), "
                f"or add it yourself: ssh-keyscan -p {self.target.port} {self.target.address} "
                f">> {self.target.known_hosts}"
            )
        client.get_host_keys().add(hostname, key.get_name(), key)
        path = Path(self.target.known_hosts).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as known_hosts:
            known_hosts.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def connect(target: SSHTarget, accept_new_host_keys: bool = False) -> paramiko.SSHClient:
    """A connected, authenticated client whose host key was verified."""
    client = paramiko.SSHClient()
    known_hosts = Path(target.known_hosts).expanduser()
    if known_hosts.exists():
        client.load_host_keys(str(known_hosts))
    client.set_missing_host_key_policy(_HostKeyPolicy(target, accept_new_host_keys))
    try:
        client.connect(
            target.address,
            port=target.port,
            username=target.user,
            key_filename=str(Path(target.key_file).expanduser()) if target.key_file else None,
            look_for_keys=target.key_file is None,
            allow_agent=target.key_file is None,
            timeout=target.connect_timeout,
            banner_timeout=target.connect_timeout,
            auth_timeout=target.connect_timeout,
        )
    except paramiko.BadHostKeyException as error:
        client.close()
        raise SSHError(
            f"host {target.name} ({target.where}) offered a {error.key.get_name()} key {error.key.fingerprint} "
            f"but {known_hosts} holds {error.expected_key.fingerprint}: the host key CHANGED. This is refused always "
            "(it may be an attack); if the host was really reinstalled, remove the old line from known_hosts"
        ) from None
    except paramiko.AuthenticationException as error:
        client.close()
        raise SSHError(
            f"host {target.name} ({target.where}): authentication failed ({error}); check user and key_file"
        ) from None
    except (TimeoutError, OSError, paramiko.SSHException) as error:
        client.close()
        if isinstance(error, SSHError):
            raise
        reason = str(error)
        if isinstance(error, paramiko.ssh_exception.NoValidConnectionsError):  # "[Errno None] Unable to connect"
            reason = "; ".join(sorted({str(cause) for cause in error.errors.values()}))
        elif reason.startswith("Error reading SSH protocol banner"):  # paramiko appends the cause without a space
            reason = "it took the connection but answered no SSH protocol banner"
        raise SSHError(
            f"host {target.name} ({target.where}) is unreachable within {target.connect_timeout:g} s: {reason}; "
            "check its address and port, and that sshd runs there"
        ) from None
    return client


@dataclass(frozen=True)
class CommandResult:
    code: int
    stdout: str
    stderr: str


EOF_GRACE_SECONDS = 2.0  # how long output is awaited after the exit status (a daemon may hold the streams open)


def run(client: paramiko.SSHClient, command: str, timeout: float = 600.0) -> CommandResult:
    """Run a shell command on the host and wait for it.  Both streams are drained as
    they come (reading one to its end first can deadlock on a full other one)."""
    channel = client.get_transport().open_session(timeout=timeout)
    channel.settimeout(timeout)
    channel.exec_command(command)
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout
    exited = float("inf")  # sshd may send the exit status before the last of the output
    while True:
        if time.monotonic() > deadline:
            channel.close()
            raise SSHError(f"`{command[:80]}` did not finish within {timeout:.0f} s")
        if channel.recv_ready():
            out += channel.recv(1 << 16)
        elif channel.recv_stderr_ready():
            err += channel.recv_stderr(1 << 16)
        elif not channel.exit_status_ready():
            channel.status_event.wait(0.05)
        elif channel.eof_received or time.monotonic() > exited + EOF_GRACE_SECONDS:
            break
        else:
            exited = min(exited, time.monotonic())
            time.sleep(0.01)
    code = channel.recv_exit_status()
    channel.close()
    return CommandResult(code, out.decode(errors="replace"), err.decode(errors="replace"))


def expand_home(client: paramiko.SSHClient, path: str) -> str:
    """``~`` on the remote host (SFTP does not expand it)."""
    if path.startswith("~"):
        home = run(client, 'printf %s "$HOME"').stdout
        return home + path[1:]
    return path


def put_file(client: paramiko.SSHClient, local: Path, remote: str, callback=None, mode: int | None = None) -> None:
    """Upload a file whole (to a temporary name, then renamed), optionally with a mode
    set before any content is written."""
    sftp = client.open_sftp()
    try:
        run(client, f"mkdir -p {shlex.quote(str(PurePosixPath(remote).parent))}")
        temporary = remote + ".partial"
        with sftp.open(temporary, "wb") as handle:
            if mode is not None:
                sftp.chmod(temporary, mode)
            handle.set_pipelined(True)
            with open(local, "rb") as source:
                sent, size = 0, local.stat().st_size
                while chunk := source.read(1 << 20):
                    handle.write(chunk)
                    sent += len(chunk)
                    if callback:
                        callback(sent, size)
        sftp.posix_rename(temporary, remote)
    finally:
        sftp.close()


def put_text(client: paramiko.SSHClient, text: str, remote: str, mode: int = 0o600) -> None:
    """Write a small file (readable by its owner only, by default) whole."""
    sftp = client.open_sftp()
    try:
        run(client, f"mkdir -p {shlex.quote(str(PurePosixPath(remote).parent))}")
        temporary = remote + ".partial"
        with sftp.open(temporary, "w") as handle:
            sftp.chmod(temporary, mode)
            handle.write(text)
        sftp.posix_rename(temporary, remote)
        if stat.S_IMODE(sftp.stat(remote).st_mode) != mode:
            raise SSHError(f"could not restrict {remote} to mode {mode:o}")
    finally:
        sftp.close()
