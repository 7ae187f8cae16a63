"""Opening buckets (local folders, or fsspec filesystems), with fresh listings and
whole-object writes.

A poller must never be fooled by a cache: every filesystem is created with
``skip_instance_cache=True`` (s3fs and gcsfs are not fork-safe, and a cached instance
would share listings) and ``use_listings_cache=False``.  s3fs and botocore each retry a
failed request several times, and their loops nest (a reset GET measured 250 requests
and 212 s before failing): for S3 both are set to one attempt, so that diloco's own
policy (:mod:`diloco_cli.store.retry`) is the one that decides and counts retries.  A
bucket on this machine is a folder (:class:`LocalFolder`, no fsspec); its files are
written to a temporary name and renamed, so a reader sees a file whole or not at all, as
with an object store's PUT.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import fsspec

# fsspec (with asyncio, 90 ms of CPU) is imported when a bucket other than a local folder is
# opened: what only names keys or protocols (`diloco plan`), or reads local buckets, does
# not pay for it
# gcsfs blocks on a gRPC call at import unless this is set first (see machine notes).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

OPTIONAL_BACKENDS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}


class StorageError(Exception):
    """A bucket cannot be used, or a call to it still failed after every retry; the
    message names the bucket (and object) and says what to do.  Deliberately not an
    ``OSError``: it is the end of the retry policy, never retried again by it."""


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def absolute_url(url: str) -> str:
    """Make ``file://`` and plain paths absolute ``file://`` URLs (processes may start elsewhere)."""
    absolute = absolute_path(url)
    return absolute if protocol_of(url) != "file" or absolute.startswith("file://") else f"file://{absolute}"


def absolute_path(url: str) -> str:
    """A plain path or ``file://`` URL made absolute against the current directory, in the
    form it came (a URL of any other protocol as it is): what a user typed, meant from
    where they typed it, for processes that start in other directories."""
    if protocol_of(url) != "file":
        return url
    prefix = "file://" if url.startswith("file://") else ""
    return prefix + str(Path(url.removeprefix("file://")).expanduser().resolve())


def open_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """A fresh filesystem for ``url`` and the path within it."""
    protocol = protocol_of(url)
    if protocol in OPTIONAL_BACKENDS:
        module, extra = OPTIONAL_BACKENDS[protocol]
        try:
            __import__(module)
        except ImportError:
            raise StorageError(
                f"{url}: the {protocol}:// backend needs {module}; pip install 'diloco-cli[{extra}]'"
            ) from None
    options = {"skip_instance_cache": True, "use_listings_cache": False, **(storage_options or {})}
    if protocol == "file":
        options = {"auto_mkdir": True, **(storage_options or {})}
    if OPTIONAL_BACKENDS.get(protocol, ("",))[0] == "s3fs":
        # a read is one GET: with max_concurrency > 1 (s3fs's default, 10) every read first
        # asks the object's size, a HEAD, and a missing object then costs a LIST as well
        options.setdefault("max_concurrency", 1)
        # one attempt per call in botocore (diloco's retry policy decides the rest)
        options["config_kwargs"] = {
            "retries": {"total_max_attempts": 1, "mode": "standard"},
            **options.get("config_kwargs", {}),
        }
    import fsspec

    try:
        filesystem, path = fsspec.core.url_to_fs(absolute_url(url), **options)
    except (ValueError, ImportError) as error:
        raise StorageError(f"{url}: cannot open this storage URL: {error}") from None
    if OPTIONAL_BACKENDS.get(protocol, ("",))[0] == "s3fs":
        filesystem.retries = 1  # and in s3fs: its loops would multiply the attempts
    return filesystem, path.rstrip("/")


def open_bucket(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem | LocalFolder, str]:
    """The filesystem an object store calls for the bucket at ``url``, and its root path:
    a local folder for ``file://`` URLs and plain paths, fsspec's filesystem for the rest."""
    if protocol_of(url) == "file":
        return LocalFolder(), absolute_path(url).removeprefix("file://").rstrip("/")
    return open_filesystem(url, storage_options)


class LocalFolder:
    """A bucket on this machine's disk: the calls an object store makes (fsspec's names and
    answers: a missing object raises ``FileNotFoundError``; ``find`` lists the files below a
    path, sorted), made with plain file operations.  fsspec's local filesystem does the same
    but importing fsspec (with asyncio) costs twice a bare interpreter's start, and ``diloco
    status`` of a local run reads nothing else."""

    protocol = "file"

    def invalidate_cache(self, path: str | None = None) -> None:
        """Nothing is cached: every listing is fresh."""

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with open(path, "rb") as handle:
            if start is None:
                return handle.read()
            handle.seek(start)
            return handle.read() if end is None else handle.read(end - start)

    def pipe_file(self, path: str, data: bytes) -> None:
        write_whole(self, path, data)

    def find(self, path: str) -> list[str]:
        return sorted(os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names)

    def rm_file(self, path: str) -> None:
        os.remove(path)

    def rm(self, path: str | list[str], recursive: bool = False) -> None:
        for each in path if isinstance(path, list) else [path]:
            if os.path.isdir(each) and not os.path.islink(each):
                if not recursive:
                    raise IsADirectoryError(f"{each} is a folder: removing it needs recursive=True")
                shutil.rmtree(each)
            else:
                os.remove(each)


def is_s3(filesystem: fsspec.AbstractFileSystem | LocalFolder) -> bool:
    return "s3" in _protocols(filesystem)


def _protocols(filesystem: fsspec.AbstractFileSystem | LocalFolder) -> tuple[str, ...]:
    protocol = filesystem.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def find_below(filesystem: fsspec.AbstractFileSystem | LocalFolder, path: str) -> list[str]:
    """The paths of every object below ``path/``, freshly listed.  On S3, one LIST per
    1000 keys: s3fs's ``find`` of a prefix that holds nothing also sends a HEAD and a LIST
    looking for an object named ``path`` (three requests where one will do; an empty
    prefix is what a poller lists most), which a stem filter on the parent avoids."""
    filesystem.invalidate_cache()
    parent, _, name = path.rpartition("/")
    try:
        if is_s3(filesystem) and parent:
            return filesystem.find(parent, prefix=name + "/")
        return filesystem.find(path)
    except FileNotFoundError:
        return []


class FolderRemoved(OSError):
    """A local write whose folder was removed while it was written (a region's bucket
    wiped and recreated): a transient failure, so the retry policy writes it again, into
    the folder made anew."""


def write_whole(filesystem: fsspec.AbstractFileSystem | LocalFolder, path: str, data: bytes) -> None:
    """Write an object so that no reader can see part of it."""
    if "file" in _protocols(filesystem):
        temporary = f"{path}.{uuid.uuid4().hex}.partial"
        try:
            Path(temporary).parent.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except FileNotFoundError as error:  # a write never answers "no such object": the folder went
            raise FolderRemoved(f"the folder of {path} was removed while it was written: {error}") from error
    else:
        filesystem.pipe_file(path, data)
