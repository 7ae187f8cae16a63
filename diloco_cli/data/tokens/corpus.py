"""Reading a corpus as documents: plain text, JSON lines or Parquet, local or at a URL.

A corpus is one file or a glob of files (``s3://bucket/corpus/*.jsonl.gz``), read in
name order and streamed: nothing holds more than a block of text and the document being
cut.  Compressed files (``.gz``, ``.bz2``, ``.xz``, ``.zst``) are read through fsspec's
decompression.  What a document is depends on the format:

* ``text``: the text between separators (a blank line, ``\\n\\n``, unless told
  otherwise); a file's end also ends a document;
* ``jsonl``: one JSON object per line, the document in its ``text_field``;
* ``parquet``: one row per document, the text in the column ``text_field`` (pyarrow,
  ``pip install 'diloco-cli[parquet]'``).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import fsspec
from fsspec.utils import infer_compression

from diloco_cli.data.tokens.index import DatasetError
from diloco_cli.data.tokens.storage import open_filesystem

CorpusFormat = Literal["auto", "text", "jsonl", "parquet"]

SUFFIX_FORMATS: dict[str, CorpusFormat] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}

TEXT_BLOCK_CHARACTERS = 4 << 20
PARQUET_BATCH_ROWS = 1024


def format_of(name: str) -> CorpusFormat:
    """The format a file name suggests (after any compression suffix): text unless it
    ends in ``.jsonl``/``.ndjson``/``.json`` or ``.parquet``/``.pq``."""
    base = name.rsplit("/", 1)[-1]
    if infer_compression(base):
        base = base.rsplit(".", 1)[0]
    return SUFFIX_FORMATS.get(posixpath.splitext(base)[1].lower(), "text")


@dataclass(frozen=True)
class Corpus:
    """Where the documents are and how to cut them."""

    url: str
    """A local path or fsspec URL of one file, or a glob of files."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    format: CorpusFormat = "auto"
    """``auto`` decides by each file's name (see :func:`format_of`)."""
    text_field: str = "text"
    """JSON lines: the key of the text; Parquet: the text column."""
    separator: str = "\n\n"
    """Plain text: what separates two documents."""

    @cached_property
    def _opened(self) -> tuple[fsspec.AbstractFileSystem, str]:
        return open_filesystem(self.url, self.storage_options)

    def files(self) -> list[str]:
        """The corpus's files in name order (paths in its filesystem)."""
        filesystem, path = self._opened
        paths = sorted(filesystem.glob(path)) if any(c in path for c in "*?[") else [path]
        files = [path for path in paths if filesystem.isfile(path)]
        if not files:
            raise DatasetError(
                f"corpus {self.url}: no such file; give a file or a glob of files (local or an fsspec URL)"
            )
        return files

    def format_of(self, path: str) -> CorpusFormat:
        return format_of(path) if self.format == "auto" else self.format

    def reads_text(self) -> bool:
        """Whether a file of the corpus is plain text (cut into documents by ``separator``)."""
        return any(self.format_of(path) == "text" for path in self.files())

    def total_bytes(self, files: list[str]) -> int | None:
        """The text to read in bytes, where the file sizes tell it (uncompressed text and
        JSON lines), else None."""
        if any(infer_compression(path) or self.format_of(path) == "parquet" for path in files):
            return None
        filesystem, _ = self._opened
        return sum(int(filesystem.size(path)) for path in files)

    def documents(self, files: list[str]) -> Iterator[str]:
        """Every non-empty document of every file, in order."""
        readers = {"text": self._text_documents, "jsonl": self._json_documents, "parquet": self._parquet_documents}
        for path in files:
            try:
                yield from readers[self.format_of(path)](path)
            except UnicodeDecodeError as error:
                raise DatasetError(f"corpus file {path} is not UTF-8 text ({error}); convert it to UTF-8") from None

    def _open_text(self, path: str) -> Any:
        filesystem, _ = self._opened
        return filesystem.open(path, "rt", encoding="utf-8", newline="", compression=infer_compression(path))

    def _text_documents(self, path: str) -> Iterator[str]:
        pending = ""
        with self._open_text(path) as handle:
            while block := handle.read(TEXT_BLOCK_CHARACTERS):
                *complete, pending = (pending + block).split(self.separator)
                yield from (document for document in complete if document)
        if pending:
            yield pending

    def _json_documents(self, path: str) -> Iterator[str]:
        with self._open_text(path) as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DatasetError(
                        f"corpus file {path} line {number} is not JSON ({error}); give --format text for plain text"
                    ) from None
                text = record.get(self.text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    keys = ", ".join(record) if isinstance(record, dict) else "none: not an object"
                    raise DatasetError(
                        f"corpus file {path} line {number} has no text in {self.text_field!r} (keys: {keys}); "
                        "name the key with --text-field"
                    )
                if text:
                    yield text

    def _parquet_documents(self, path: str) -> Iterator[str]:
        try:
            import pyarrow.parquet as parquet
        except ImportError:
            raise DatasetError(
                f"corpus file {path} is Parquet, which needs pyarrow: pip install 'diloco-cli[parquet]'"
            ) from None
        filesystem, _ = self._opened
        with filesystem.open(path, "rb") as handle:
            table = parquet.ParquetFile(handle)
            columns = table.schema_arrow.names
            if self.text_field not in columns:
                raise DatasetError(
                    f"corpus file {path} has no column {self.text_field!r} (columns: {', '.join(columns)}); "
                    "name the text column with --text-field"
                )
            for batch in table.iter_batches(columns=[self.text_field], batch_size=PARQUET_BATCH_ROWS):
                yield from (text for text in batch.column(0).to_pylist() if text)
