"""Where datasets live: fsspec locations (opened as the store opens buckets), hashes, retried calls.

A dataset is read by ranged requests only, so every filesystem is opened fresh (no
instance or listing cache: another process may have just written the objects) and read
with ``cat_file(path, start, end)``, which reads exactly the bytes asked for (no block
cache reading ahead behind our back).
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import fsspec

from diloco_cli.data.tokens.index import INDEX_NAME, DatasetError, DatasetIndex, parse_index
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.filesystem import open_filesystem as store_filesystem

Result = TypeVar("Result")

Retry = Callable[[Callable[[], Any]], Any]
"""Runs a storage call, retrying it as the caller's policy says; ``call_once`` does not retry."""

HASH_BLOCK_BYTES = 8 << 20


def call_once(call: Callable[[], Result]) -> Result:
    return call()


def open_filesystem(url: str, storage_options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """A fresh filesystem for ``url`` (a local path or an fsspec URL) and the path in it,
    opened as the store opens buckets (no caches; the caller's retry policy decides)."""
    try:
        return store_filesystem(url, storage_options)
    except StorageError as error:
        raise DatasetError(str(error)) from None


@dataclass(frozen=True)
class Location:
    """A dataset's directory: its URL, the filesystem options and the index's file name."""

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    index_name: str = INDEX_NAME

    @classmethod
    def of_index(cls, index_url: str, storage_options: dict[str, Any]) -> Location:
        """The location whose index is ``index_url``."""
        directory, _, name = index_url.rstrip("/").rpartition("/")
        return cls(directory or ".", storage_options, name)

    @property
    def index_url(self) -> str:
        return f"{self.url.rstrip('/')}/{self.index_name}"

    @property
    def is_local(self) -> bool:
        return "://" not in self.url or self.url.startswith("file://")

    def open(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """The location's filesystem and its directory there (opened once: a client of
        an object store costs a round trip or more to set up)."""
        return self._opened

    @cached_property
    def _opened(self) -> tuple[fsspec.AbstractFileSystem, str]:
        return open_filesystem(self.url, self.storage_options)


def join(directory: str, name: str) -> str:
    return posixpath.join(directory, name)


def read_if_present(filesystem: fsspec.AbstractFileSystem, path: str, retry: Retry = call_once) -> bytes | None:
    """The object's bytes, or None where there is none."""
    try:
        return retry(lambda: filesystem.cat_file(path))
    except FileNotFoundError:
        return None


def remove_if_present(filesystem: fsspec.AbstractFileSystem, path: str, retry: Retry = call_once) -> None:
    try:
        retry(lambda: filesystem.rm_file(path))
    except FileNotFoundError:
        pass


def size_if_present(filesystem: fsspec.AbstractFileSystem, path: str, retry: Retry = call_once) -> int | None:
    try:
        return int(retry(lambda: filesystem.info(path))["size"])
    except FileNotFoundError:
        return None


def file_sha256(path: Path) -> str:
    """SHA-256 of a local file, read block by block."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def read_index(location: Location, retry: Retry = call_once) -> DatasetIndex:
    """The dataset index of ``location``, or a :class:`DatasetError` saying what to do."""
    filesystem, root = location.open()
    data = read_if_present(filesystem, join(root, location.index_name), retry)
    if data is None:
        raise DatasetError(
            f"no dataset index at {location.index_url}: make the dataset with `diloco prepare CORPUS -o DIRECTORY`, "
            "or index shards you have with `diloco prepare --existing DIRECTORY`"
        )
    return parse_index(data, location.index_url)
