"""The fuzzer: hostile bytes against every reader of untrusted input; nothing untyped escapes.

Each target is one reader of bytes that come from a bucket or a file a stranger may have
written: the payload frame (``decode_payload``, ``read_header``, ``declared_values``, and
``decode_payload`` of frames re-tagged with the run's key, so that mutated headers get
past the tag and reach the parser), the sealed documents (as stored, and re-sealed so
that mutated bodies reach validation), the run manifest and the dataset index.  For a
fixed time each is fed inputs made from valid seeds: bits flipped, bytes set to boundary
values, truncated, extended, chunks deleted or repeated, two seeds spliced, a frame's
declared lengths set to extremes, and in JSON one value replaced deep inside (huge or
negative numbers, wrong types, long strings, deep nesting), plus random bytes.  Inputs
that raise a typed error not seen before join the seeds.  A target may raise only its
reader's typed errors; anything else escaping is reported with the input that caused it.

    python -m tests.fuzz             # the long form: 10 minutes in all (75 s per target)
    python -m tests.fuzz --quick     # 2 s per target

It lives with the tests: tests/integration/test_fuzz_quick.py runs its quick form (1 s per target),
tests/unit/test_fuzz.py runs the same targets and mutations under hypothesis.  Its result is
written as the benchmarks' are (bench/_common.py), to bench/results/fuzz.json by default.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch

from bench._common import benchmark_parser, print_table, write_and_report
from diloco_cli.codec import (
    CodecSpec,
    PayloadError,
    RunSecret,
    declared_values,
    decode_payload,
    encode_payload,
    read_header,
)
from diloco_cli.codec.frame import MAGIC, PREFIX, TAG_BYTES
from diloco_cli.data.tokens.index import DatasetError, DatasetIndex, ShardEntry, parse_index
from diloco_cli.store.documents import (
    ControlNote,
    DamagedDocument,
    EpochRecord,
    ForgedDocument,
    Head,
    Heartbeat,
    Refusals,
    SyncerStatus,
    _canonical,
    _tag,
    seal,
    unseal,
)
from diloco_cli.store.run_spec import ManifestError, read_run_spec

SECRET = RunSecret(bytes(range(32)))
DOCUMENT_KEY = "global/head.json"
MANIFEST_URL = "memory://diloco-fuzz/manifest.json"
DOCUMENT_MODELS = (Heartbeat, Head, SyncerStatus, ControlNote, EpochRecord)
EXAMPLE_BYTES = 4096
"""How much of an input that let an untyped error escape the result keeps."""


# ----------------------------------------------------------------------------- readers


def read_declared(data: bytes) -> None:
    """``declared_values`` never raises: it counts what a frame declares, 0 for junk."""
    values = declared_values(data)
    if not isinstance(values, int) or values < 0:
        raise AssertionError(f"declared_values returned {values!r}")


def split_resigned(data: bytes) -> tuple[bytes, bytes]:
    """A re-tagged frame's input: its header JSON, a NUL, its body (no NUL: all header)."""
    header, _, body = data.partition(b"\0")
    return header, body


def resigned_frame(header: bytes, body: bytes) -> bytes:
    """A frame of this header and body with a valid prefix and tag: what only a holder
    of the run's key could write, so every check after the tag is exercised."""
    prefix = PREFIX.pack(MAGIC, 1, 0, SECRET.fingerprint, len(header), len(body))
    tag = hashlib.blake2b(prefix + header + body, key=SECRET.key, digest_size=TAG_BYTES).digest()
    return prefix + header + body + tag


def decode_resigned(data: bytes) -> None:
    decode_payload(resigned_frame(*split_resigned(data)), SECRET)


def unseal_every_model(data: bytes) -> None:
    """Read ``data`` as each kind of document, verified and not; refused when no kind
    accepts it."""
    refused = None
    for model in DOCUMENT_MODELS:
        for secret in (SECRET, None):
            try:
                unseal(data, DOCUMENT_KEY, model, secret)
            except (DamagedDocument, ForgedDocument) as error:
                refused = error
            else:
                return
    raise refused


def unseal_resealed(data: bytes) -> None:
    """``data`` is a document body: sealed with the run's key (when it can be), then read
    as each kind of document; refused when no kind accepts it."""
    try:
        body = json.loads(data)
        sealed = json.dumps({"document": body, "tag": _tag(DOCUMENT_KEY, _canonical(body), SECRET)}).encode()
    except (ValueError, RecursionError):  # not JSON, or not sealable: stored as it is
        sealed = data
    refused = None
    for model in DOCUMENT_MODELS:
        try:
            unseal(sealed, DOCUMENT_KEY, model, SECRET)
        except DamagedDocument as error:
            refused = error
        else:
            return
    raise refused


def read_manifest(data: bytes) -> None:
    fsspec.filesystem("memory").pipe_file(MANIFEST_URL, data)
    read_run_spec(MANIFEST_URL)


def read_index(data: bytes) -> None:
    parse_index(data, "memory://diloco-fuzz/index.json")


# ------------------------------------------------------------------------------- seeds


def frame_seeds() -> list[bytes]:
    tensors = [("w", torch.linspace(-1, 1, 96).reshape(8, 12)), ("b", torch.ones(5))]
    seeds = [
        encode_payload(tensors, CodecSpec(codec=codec, zstd_level=level), SECRET, {"learner": "east-0", "fragment": 1})
        for codec in ("fp32", "bf16", "int8", "int4", "int2", "topk")
        for level in (0, 1)
    ]
    seeds.append(
        encode_payload([], CodecSpec(zstd_level=0), SECRET, {"learner": "east-0", "sequence": 1000001})
    )  # a marker
    return seeds


def resigned_seeds() -> list[bytes]:
    seeds = []
    for frame in frame_seeds():
        _, _, _, _, header_bytes, body_bytes = PREFIX.unpack_from(frame)
        header = frame[PREFIX.size : PREFIX.size + header_bytes]
        seeds.append(header + b"\0" + frame[PREFIX.size + header_bytes : PREFIX.size + header_bytes + body_bytes])
    return seeds


def sample_documents() -> list[Any]:
    refusals = Refusals()
    refusals.record("payload", "payloads/east-0/000-000001000001.dlc", "tag mismatch", 1.0)
    return [
        Heartbeat(
            learner="east-0",
            region="east",
            host="local",
            pid=7,
            state="training",
            step=40,
            total_steps=400,
            tokens=81920,
            loss=2.5,
            base_versions={0: 3, 1: 4},
            refusals=refusals,
            started_at=0.0,
            time=9.0,
        ),
        Head(
            version=9,
            fragment_versions={0: 8, 1: 9},
            fragment_digests={0: "ab" * 32},
            snapshot_version=6,
            recent=((7, 1), (8, 0), (9, 1)),
            recent_from=6,
        ),
        SyncerStatus(
            state="running",
            run="fuzz",
            version=9,
            fragment_versions={0: 8, 1: 9},
            snapshot_version=6,
            merges=9,
            merges_per_minute=3,
            quorum=2,
            effective_quorum=2,
            grace_seconds=0.5,
            live_learners=["east-0"],
            refusals={"east": refusals},
            started_at=0.0,
            time=9.0,
        ),
        ControlNote(resync_serial=2, fragment=1, reason="base too old", time=3.0),
        EpochRecord(epoch=3),
    ]


def document_seeds() -> list[bytes]:
    return [seal(document, DOCUMENT_KEY, SECRET) for document in sample_documents()]


def body_seeds() -> list[bytes]:
    return [json.dumps(document.model_dump(mode="json")).encode() for document in sample_documents()]


def manifest_seeds() -> list[bytes]:
    from diloco_cli.config.recipe import Recipe
    from diloco_cli.config.regions import RegionsFile
    from diloco_cli.launch.resolve import resolve_run

    spec = resolve_run(Recipe(), RegionsFile(), "fuzz", Path("/nonexistent/runs"))
    return [spec.to_json().encode(), json.dumps({"spec": json.loads(spec.to_json())}).encode()]


def index_seeds() -> list[bytes]:
    shard = lambda name, tokens: ShardEntry(name=name, tokens=tokens, sha256="0" * 64)  # noqa: E731
    index = DatasetIndex(
        dtype="uint16",
        vocab_size=50257,
        tokenizer="tokenizer.json",
        tokenizer_sha256="f" * 64,
        eos_token_id=50256,
        train=(shard("train-000.bin", 1000), shard("train-001.bin", 20)),
        heldout=shard("heldout.bin", 50),
    )
    return [index.to_json()]


# ----------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """A reader of untrusted bytes, the errors it may raise, and valid inputs to start from."""

    name: str
    read: Callable[[bytes], object]
    typed: tuple[type[BaseException], ...]
    seeds: Callable[[], list[bytes]]
    layout: str
    """``frame`` (binary), ``json``, or ``resigned`` (header JSON, NUL, body)."""


TARGETS = (
    Target("frame.decode_payload", lambda data: decode_payload(data, SECRET), (PayloadError,), frame_seeds, "frame"),
    Target("frame.read_header", lambda data: read_header(data, SECRET), (PayloadError,), frame_seeds, "frame"),
    Target("frame.declared_values", read_declared, (), frame_seeds, "frame"),
    Target("frame.decode_payload (re-tagged)", decode_resigned, (PayloadError,), resigned_seeds, "resigned"),
    Target("documents.unseal", unseal_every_model, (DamagedDocument, ForgedDocument), document_seeds, "json"),
    Target("documents.unseal (re-sealed)", unseal_resealed, (DamagedDocument,), body_seeds, "json"),
    Target("run_spec.read_run_spec", read_manifest, (ManifestError,), manifest_seeds, "json"),
    Target("datasets.parse_index", read_index, (DatasetError,), index_seeds, "json"),
)


# ---------------------------------------------------------------------------- mutators

BOUNDARY_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, ord("{"), ord('"'), ord("\\"))
HEADER_LENGTHS = (0, 1, 2, 27, 28, 255, 1 << 16, (16 << 20) + 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1)
BODY_LENGTHS = (0, 1, 7, 8, 1 << 32, (64 << 30) + 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)
HOSTILE_JSON = (
    "9" * 5000,  # more digits than int() converts
    "-1",
    "0",
    str(1 << 64),
    str(-(1 << 63) - 1),
    "1e999",  # infinity
    "-0.0",
    "NaN",
    "Infinity",
    "1.5",
    "null",
    "true",
    "[]",
    "{}",
    '""',
    '"' + "x" * 100_000 + '"',
    '"\\ud800"',  # a lone surrogate
    "[" * 5000 + "]" * 5000,  # deeper than the JSON decoder recurses
    '{"a":' * 3000 + "1" + "}" * 3000,
    "[" * 50 + "]" * 50,
    '"../../etc/passwd"',
    '"/abs"',
    '"float32"',
    '"int4"',
    "[-1, 2]",
    "[4294967296, 4294967296]",
    "[0]",
)


def _chunk(rng: random.Random, data: bytes) -> tuple[int, int]:
    start = rng.randrange(len(data) + 1)
    return start, min(len(data), start + rng.choice((1, 2, 4, 8, 64, 1024)))


def flip_bits(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return bytes([rng.randrange(256)])
    changed = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        changed[rng.randrange(len(changed))] ^= 1 << rng.randrange(8)
    return bytes(changed)


def set_bytes(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return bytes([rng.choice(BOUNDARY_BYTES)])
    changed = bytearray(data)
    for _ in range(rng.choice((1, 2, 4))):
        changed[rng.randrange(len(changed))] = rng.choice(BOUNDARY_BYTES)
    return bytes(changed)


def truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data) + 1)]


def extend(rng: random.Random, data: bytes) -> bytes:
    return data + rng.choice(
        (b"\0", b"\xff" * 8, rng.randbytes(rng.choice((1, 32, 1024))), data[: rng.randrange(len(data) + 1)])
    )


def delete_chunk(rng: random.Random, data: bytes) -> bytes:
    start, end = _chunk(rng, data)
    return data[:start] + data[end:]


def repeat_chunk(rng: random.Random, data: bytes) -> bytes:
    start, end = _chunk(rng, data)
    return data[:end] + data[start:end] * rng.choice((1, 2, 16)) + data[end:]


def declared_lengths(rng: random.Random, data: bytes) -> bytes:
    """A frame whose prefix declares an extreme header or body length (tag unchanged)."""
    if len(data) < PREFIX.size:
        return data
    magic, version, flags, fingerprint, header_bytes, body_bytes = PREFIX.unpack_from(data)
    if rng.random() < 0.5:
        header_bytes = rng.choice((*HEADER_LENGTHS, max(0, header_bytes - 1), min(header_bytes + 1, (1 << 32) - 1)))
    else:
        body_bytes = rng.choice((*BODY_LENGTHS, max(0, body_bytes - 1), min(body_bytes + 1, (1 << 64) - 1)))
    return PREFIX.pack(magic, version, flags, fingerprint, header_bytes, body_bytes) + data[PREFIX.size :]


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    found = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*path, index))
    return found


PLACEHOLDER = "\u0001diloco-fuzz\u0001"


def json_value(rng: random.Random, data: bytes) -> bytes:
    """One value deep inside the JSON replaced by a hostile one, deleted, or given a
    sibling key: what gets past ``json.loads`` and reaches validation."""
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return data
    paths = _paths(document)
    path = rng.choice(paths)
    if not path:
        return rng.choice(HOSTILE_JSON).encode()
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    action = rng.random()
    if action < 0.15 and isinstance(parent, dict):
        del parent[path[-1]]
    elif action < 0.25 and isinstance(parent, dict):
        parent[f"extra-{rng.randrange(99)}"] = PLACEHOLDER
    else:
        parent[path[-1]] = PLACEHOLDER
    return json.dumps(document).replace(json.dumps(PLACEHOLDER), rng.choice(HOSTILE_JSON)).encode()


def resigned_json_value(rng: random.Random, data: bytes) -> bytes:
    header, body = split_resigned(data)
    return json_value(rng, header) + b"\0" + body


def splice(rng: random.Random, data: bytes, other: bytes) -> bytes:
    return data[: rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1) :]


BYTE_MUTATORS = (flip_bits, set_bytes, truncate, extend, delete_chunk, repeat_chunk)
STRUCTURED = {"frame": (declared_lengths,), "json": (json_value,), "resigned": (resigned_json_value,)}


def mutate(rng: random.Random, target: Target, corpus: list[bytes]) -> bytes:
    """A new input: random bytes now and then, else a corpus entry mutated 1 to 4 times
    (structure-aware mutations half of the time)."""
    if rng.random() < 0.03:
        return rng.randbytes(rng.choice((0, 1, 8, 27, 28, 29, 64, 1024)))
    data = rng.choice(corpus)
    for _ in range(rng.choice((1, 1, 2, 4))):
        choice = rng.random()
        if choice < 0.5:
            data = rng.choice(STRUCTURED[target.layout])(rng, data)
        elif choice < 0.55:
            data = splice(rng, data, rng.choice(corpus))
        else:
            data = rng.choice(BYTE_MUTATORS)(rng, data)
    return data


# --------------------------------------------------------------------------------- run


VARIABLE_PARTS = re.compile(r"'[^']*'|\"[^\"]*\"|\(got [^)]*\)|byte 0x[0-9a-f]+|[0-9]+")
"""Quoted parts, the offending values and numbers: what differs between two inputs
failing the same check."""


def signature(error: BaseException) -> str:
    """An error's type and message without its variable parts: how distinct typed
    errors are told apart."""
    message = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {VARIABLE_PARTS.sub('…', message)[:100]}"


def attempt(target: Target, data: bytes) -> BaseException | None:
    """Read ``data``; the error it raised, if any (never an untyped one silently)."""
    try:
        target.read(data)
    except Exception as error:
        return error
    return None


def fuzz(target: Target, seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(f"{seed}:{target.name}")
    corpus = target.seeds()
    for data in corpus:
        if (error := attempt(target, data)) is not None:
            raise AssertionError(f"{target.name}: a valid seed is refused: {error!r}")
    tried, accepted = 0, 0
    typed: Counter[str] = Counter()
    untyped: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(20):
            data = mutate(rng, target, corpus)
            tried += 1
            error = attempt(target, data)
            if error is None:
                accepted += 1
            elif isinstance(error, target.typed):
                key = signature(error)
                if key not in typed and len(corpus) < 2000:
                    corpus.append(data)  # a new way to fail: explore from it
                typed[key] += 1
            else:
                key = signature(error)
                found = untyped.setdefault(
                    key,
                    {
                        "error": f"{type(error).__name__}: {str(error)[:200]}",
                        "count": 0,
                        "input_bytes": len(data),
                        "input_base64": base64.b64encode(data[:EXAMPLE_BYTES]).decode(),
                    },
                )
                found["count"] += 1
    by_type: Counter[str] = Counter()
    for key, count in typed.items():
        by_type[key.split(":")[0]] += count
    return {
        "target": target.name,
        "seconds": seconds,
        "inputs": tried,
        "inputs_per_second": tried / seconds,
        "accepted": accepted,
        "typed_errors": sum(typed.values()),
        "distinct_typed_errors": len(typed),
        "typed_error_types": dict(by_type),
        "untyped": sum(found["count"] for found in untyped.values()),
        "untyped_examples": list(untyped.values()),
        "corpus": len(corpus),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "2 s per target (the test suite)")
    parser.add_argument("--seconds", type=float, help="per target (default 75: 10 minutes in all; --quick: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", help="run only the targets whose name contains this")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seconds = args.seconds or (2.0 if args.quick else 75.0)
    targets = [target for target in TARGETS if not args.only or args.only in target.name]
    rows = []
    for target in targets:
        row = fuzz(target, seconds, args.seed)
        rows.append(row)
        print(
            f"  {target.name}: {row['inputs']} inputs, {row['distinct_typed_errors']} distinct typed errors, "
            f"{row['untyped']} untyped",
            flush=True,
        )
    results = {
        "rows": rows,
        "inputs": sum(row["inputs"] for row in rows),
        "untyped": sum(row["untyped"] for row in rows),
        "target": "no untyped error escapes any reader",
        "met": all(row["untyped"] == 0 for row in rows),
    }
    settings = {"seconds_per_target": seconds, "seed": args.seed, "targets": [target.name for target in targets]}
    print_table(rows, ["target", "inputs", "inputs_per_second", "accepted", "distinct_typed_errors", "untyped"])
    write_and_report("fuzz", args, settings, results)
    return results


if __name__ == "__main__":
    main()
