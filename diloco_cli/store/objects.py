"""An object store rooted at one URL: whole-object reads and writes, fresh listings,
marked objects, and a count of the bytes that crossed in each direction."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from diloco_cli.store.filesystem import StorageError, open_filesystem, write_whole

MARKER_SUFFIX = ".ready"
"""A marked object ``X`` is trusted only once ``X.ready`` exists (written after ``X``)."""


@dataclass
class ByteCounter:
    """Bytes written to (up) and read from (down) a store by this process."""

    up: int = 0
    down: int = 0


class ObjectStore:
    """Objects under ``root`` (an fsspec URL); keys are ``/``-separated relative paths."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root = root.rstrip("/")
        self._storage_options = dict(storage_options or {})
        self._filesystem, self._path = open_filesystem(self.root, self._storage_options)
        self.bytes = ByteCounter()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ObjectStore({self.root!r})"

    def _full(self, key: str) -> str:
        return f"{self._path}/{key}" if key else self._path

    def _count(self, up: int = 0, down: int = 0) -> None:
        with self._lock:
            self.bytes.up += up
            self.bytes.down += down

    def put(self, key: str, data: bytes) -> None:
        """Write a whole object (replacing it: use only for mutable objects or new keys)."""
        try:
            write_whole(self._filesystem, self._full(key), data)
        except OSError as error:
            raise StorageError(f"cannot write {self.root}/{key}: {error}") from error
        self._count(up=len(data))

    def get(self, key: str) -> bytes:
        """Read a whole object; FileNotFoundError when it does not exist."""
        data = self._filesystem.cat_file(self._full(key))
        self._count(down=len(data))
        return data

    def get_json(self, key: str) -> Any | None:
        """A JSON object, or None when it does not exist (or is not valid JSON)."""
        try:
            return json.loads(self.get(key))
        except FileNotFoundError:
            return None
        except ValueError:
            return None

    def put_json(self, key: str, value: Any) -> None:
        self.put(key, json.dumps(value, separators=(",", ":"), sort_keys=True).encode())

    def exists(self, key: str) -> bool:
        return self._filesystem.exists(self._full(key))

    def list(self, prefix: str) -> list[str]:
        """Keys of every object under ``prefix/``, freshly listed (recursive, sorted)."""
        self._filesystem.invalidate_cache()
        try:
            found = self._filesystem.find(self._full(prefix))
        except FileNotFoundError:
            return []
        start = len(self._path) + 1
        return sorted(path[start:] for path in found if not path.endswith(".partial"))

    def delete(self, key: str) -> None:
        try:
            self._filesystem.rm_file(self._full(key))
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ marked objects

    def put_marked(self, key: str, data: bytes, marker: bytes) -> None:
        """Write an immutable object, then its marker: readers trust it only after both."""
        self.put(key, data)
        self.put(key + MARKER_SUFFIX, marker)

    def list_marked(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` whose marker exists (the object itself is then whole)."""
        return [key[: -len(MARKER_SUFFIX)] for key in self.list(prefix) if key.endswith(MARKER_SUFFIX)]

    def get_marker(self, key: str) -> bytes:
        return self.get(key + MARKER_SUFFIX)

    def delete_marked(self, key: str) -> None:
        """Remove the marker first, so the object is never trusted without it."""
        self.delete(key + MARKER_SUFFIX)
        self.delete(key)

    def probe(self) -> None:
        """Write, read and delete a probe object; StorageError names the bucket if any fails."""
        key = "diloco-probe"
        try:
            write_whole(self._filesystem, self._full(key), b"probe")
            if self._filesystem.cat_file(self._full(key)) != b"probe":
                raise StorageError(f"{self.root}: a probe object read back differently")
            self._filesystem.rm_file(self._full(key))
        except StorageError:
            raise
        except Exception as error:  # any backend's failure means the bucket is unusable
            raise StorageError(
                f"bucket {self.root} cannot be written, read and deleted: {type(error).__name__}: {error}. "
                "Check the URL, that the bucket exists, and the credentials in the environment."
            ) from None
