"""What a storage request carries besides the object: HTTP heads and protocol envelopes.

The meter counts the bytes of every object written and read exactly, but a request also
sends a start line and header fields (a signed S3 request: about 800 bytes, with the
object's path) and gets a status line and header fields back (250-530 bytes), and some
answers have a body that is not an object: the XML of "no such key", the JSON object
resource GCS returns for every upload.  On the WAN these are a few percent of the bytes
for the default job's payloads, and most of the bytes of the small documents (heads,
heartbeats, markers) that are read and written all the time.

They are estimated per request from :data:`WIRE_MODELS`, measured by an HTTP proxy that
counted every byte in front of moto (S3) and fake-gcs-server (GCS): the estimate of one
request is within about 10% of what went through (tests/integration/test_metering.py
checks a mix of every store operation within 1% of all bytes).  Real endpoints differ a
little (AWS adds ``x-amz-id-2`` and ``x-amz-request-id`` to each answer, about 100 bytes);
local files carry none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOverhead:
    """The bytes of one request besides its object's, for one kind of operation."""

    up: int
    """Sent: the request's head (start line, header fields, blank line) and any envelope
    around the body, besides the object's path (added per request)."""
    down: int
    """Received: the response's head and any body that is not the object's bytes."""
    path_echoes_down: int = 0
    """How often the answer repeats the object's path (GCS's object resource names it in
    its id, name, selfLink and mediaLink)."""


@dataclass(frozen=True)
class WireModel:
    """The overheads of one backend: by operation (``read``, ``write``, ``list``,
    ``delete``), for an answer that the object does not exist, and for a batch deletion."""

    operations: dict[str, RequestOverhead]
    missing_down: int
    """Received for "no such object" instead of the operation's ``down``."""
    batch: RequestOverhead = RequestOverhead(0, 0)
    """A batch deletion's envelopes besides a deletion's (its request and answer bodies)."""
    batch_key: RequestOverhead = RequestOverhead(0, 0)
    """Each key's part of them besides its path (which both name)."""
    over_http: bool = True
    """Whether requests go over HTTP at all, naming their object's path (not local files)."""

    def estimate(self, op: str, path: str, *, missing: bool = False) -> tuple[int, int]:
        """(up, down) bytes besides the object's for one request to the object at ``path``."""
        up, down = self.per_request(op, len(path))
        return int(up), self.missing_down if missing else int(down)

    def per_request(self, op: str, path_bytes: float) -> tuple[float, float]:
        """(up, down) bytes besides the object's of a request whose path is ``path_bytes``
        long, answered (what ``diloco plan`` adds per request)."""
        if not self.over_http:
            return 0.0, 0.0
        overhead = self.operations[op]
        return overhead.up + path_bytes, overhead.down + overhead.path_echoes_down * path_bytes

    def estimate_batch(self, bucket_path: str, paths: Sequence[str]) -> tuple[int, int]:
        """(up, down) bytes of one request deleting the objects at ``paths`` together."""
        if not self.over_http:
            return 0, 0
        up, down = self.estimate("delete", bucket_path)
        keys = sum(len(path) for path in paths)
        return (
            up + self.batch.up + len(paths) * self.batch_key.up + keys,
            down + self.batch.down + len(paths) * self.batch_key.down + keys,
        )


S3_WIRE = WireModel(
    operations={
        # PUT: SigV4 fields, checksum, content length (moto 5.2.6 answers 377 B, earlier ones 415)
        "write": RequestOverhead(up=860, down=385),
        "read": RequestOverhead(up=750, down=525),  # GET (ETag, Last-Modified, Content-Range...)
        "list": RequestOverhead(up=750, down=270),  # ListObjectsV2 (its body is estimated as listing bytes)
        "delete": RequestOverhead(up=715, down=245),  # DeleteObject: 204, no body
    },
    missing_down=630,  # a 404 head and its <Error><Code>NoSuchKey</Code>... body
    batch=RequestOverhead(up=180, down=110),  # DeleteObjects: <Delete xmlns=...>, Content-MD5; <DeleteResult>
    batch_key=RequestOverhead(up=30, down=35),  # <Object><Key>..</Key></Object>; <Deleted><Key>..</Key></Deleted>
)
"""S3's signed requests, measured against moto (docs/bandwidth.md, "What the meter counts")."""

GCS_WIRE = WireModel(
    operations={
        "write": RequestOverhead(up=360, down=820, path_echoes_down=5),  # multipart upload; the object resource
        "read": RequestOverhead(up=160, down=400),
        "list": RequestOverhead(up=170, down=110),
        "delete": RequestOverhead(up=165, down=110),
    },
    missing_down=170,
    batch=RequestOverhead(up=200, down=300),  # the batch endpoint's multipart/mixed envelopes
    batch_key=RequestOverhead(up=200, down=250),
)
"""GCS's JSON API (without an OAuth token: a real one adds about 200 bytes up per
request), measured against fake-gcs-server."""

NO_WIRE = WireModel(operations={}, missing_down=0, over_http=False)
"""Local files (and memory): nothing but the objects."""

WIRE_MODELS = {"s3": S3_WIRE, "s3a": S3_WIRE, "gs": GCS_WIRE, "gcs": GCS_WIRE}


def wire_model(protocol: str) -> WireModel:
    """The overheads of a storage URL's protocol (none for local files and unknown ones)."""
    return WIRE_MODELS.get(protocol, NO_WIRE)
