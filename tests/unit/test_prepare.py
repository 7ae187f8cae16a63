"""``diloco prepare``: real corpora (text, JSON lines, Parquet) through a real tokenizer
into shards on disk and in S3 (moto), interrupted and resumed, in every region's bucket.

Every dataset is checked the same way: its files match the index (sizes and SHA-256)
and its shards decode, document by document, back to the corpus.
"""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from typer.testing import CliRunner

from diloco_cli.cli.app import app
from diloco_cli.data.tokens.corpus import Corpus
from diloco_cli.data.tokens.index import DatasetIndex
from diloco_cli.data.tokens.prepare import PrepareRequest, prepare_dataset
from diloco_cli.data.tokens.progress import Silent
from diloco_cli.data.tokens.shards import PROGRESS_NAME, is_heldout, read_progress
from diloco_cli.data.tokens.storage import Location
from diloco_cli.data.tokens.stream import TokenBatches
from tests.support.delay_proxy import delay_proxy
from tests.support.runs import write_yaml

runner = CliRunner()

WORDS = [
    "the",
    "king",
    "crown",
    "naïve",
    "café",
    "über",
    "—",
    "sea",
    "1606",
    "storm",
    "🌊",
    "said",
    "to",
    "a",
    "of",
    "Ω",
    "fool",
    "night",
]


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Documents of a few lines of words (ASCII and not), none with a blank line."""
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(1, 4))]
        documents.append("\n".join(lines) + rng.choice(["", ".", "!"]))
    return documents


def write_text_corpus(path: Path, documents: list[str]) -> Path:
    path.write_text("\n\n".join(documents), encoding="utf-8")
    return path


def prepare(*args: str) -> str:
    result = runner.invoke(app, ["prepare", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def read_dataset(directory: Path) -> tuple[DatasetIndex, dict[str, bytes]]:
    index = DatasetIndex.model_validate_json((directory / "index.json").read_bytes())
    files = {entry.name: (directory / entry.name).read_bytes() for entry in (*index.train, index.heldout)}
    return index, files


def assert_matches_index(index: DatasetIndex, files: dict[str, bytes]) -> None:
    for entry in (*index.train, index.heldout):
        assert len(files[entry.name]) == entry.tokens * index.item_bytes, entry.name
        assert hashlib.sha256(files[entry.name]).hexdigest() == entry.sha256, entry.name


def decoded_documents(
    index: DatasetIndex, files: dict[str, bytes], tokenizer_json: bytes, heldout_fraction: float
) -> list[str]:
    """The corpus's documents in order, decoded from the training and held-out shards."""
    tokenizer = Tokenizer.from_str(tokenizer_json.decode())
    assert hashlib.sha256(tokenizer_json).hexdigest() == index.tokenizer_sha256

    def documents_of(data: bytes) -> list[str]:
        tokens = np.frombuffer(data, dtype=index.dtype).tolist()
        ends = [i for i, token in enumerate(tokens) if token == index.eos_token_id]
        assert ends and ends[-1] == len(tokens) - 1  # every document ends with the EOS token
        starts = [0] + [end + 1 for end in ends[:-1]]
        return [tokenizer.decode(tokens[start:end], skip_special_tokens=False) for start, end in zip(starts, ends)]

    train = documents_of(b"".join(files[entry.name] for entry in index.train))
    heldout = documents_of(files[index.heldout.name])
    assert 1 <= len(heldout) < len(train)
    merged = []
    for number in range(len(train) + len(heldout)):
        merged.append(heldout.pop(0) if is_heldout(number, heldout_fraction) else train.pop(0))
    return merged


def check_dataset(directory: Path, documents: list[str], heldout_fraction: float = 0.01) -> DatasetIndex:
    index, files = read_dataset(directory)
    assert_matches_index(index, files)
    assert decoded_documents(index, files, (directory / index.tokenizer).read_bytes(), heldout_fraction) == documents
    return index


def test_prepare_text_round_trips_through_the_trained_tokenizer(tmp_path):
    documents = make_documents(300)
    corpus = write_text_corpus(tmp_path / "corpus.txt", documents)
    output = prepare(
        str(corpus),
        "-o",
        str(tmp_path / "out"),
        "--vocab-size",
        "300",
        "--shard-tokens",
        "3000",
        "--heldout-fraction",
        "0.05",
    )
    index = check_dataset(tmp_path / "out", documents, 0.05)
    assert index.format == "diloco-tokens/1" and index.dtype == "uint16" and index.vocab_size <= 300
    assert index.tokenizer == "tokenizer.json" and index.eos_token_id is not None
    assert len(index.train) > 3 and all(entry.tokens == 3000 for entry in index.train[:-1])
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == sorted(
        ["index.json", "tokenizer.json", "heldout.bin", *(e.name for e in index.train)]
    )
    assert f"index: {tmp_path / 'out' / 'index.json'}" in output


@pytest.mark.parametrize("corpus_format", ["jsonl", "parquet"])
def test_prepare_json_lines_and_parquet_take_the_named_text_field(tmp_path, corpus_format):
    documents = make_documents(200, seed=1)
    records = [{"id": number, "body": document} for number, document in enumerate(documents)]
    if corpus_format == "jsonl":
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(record) + "\n" for record in records))
    else:
        import pyarrow
        import pyarrow.parquet

        corpus = tmp_path / "corpus.parquet"
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), corpus, row_group_size=64)
    prepare(
        str(corpus),
        "-o",
        str(tmp_path / "out"),
        "--text-field",
        "body",
        "--vocab-size",
        "320",
        "--shard-tokens",
        "2500",
    )
    check_dataset(tmp_path / "out", documents)


class Interrupted(Exception):
    pass


class InterruptAfterShards(Silent):
    """Stops prepare once ``count`` new training shards are recorded (as a kill would)."""

    def __init__(self, count: int) -> None:
        self.left = count

    def done(self, item: str, reused: bool) -> None:
        if item.startswith("train-") and not reused:
            self.left -= 1
            if self.left == 0:
                raise Interrupted(item)


def test_an_interrupted_tokenizing_goes_on_without_redoing_a_finished_shard(tmp_path):
    documents = make_documents(400, seed=2)
    corpus = Corpus(str(write_text_corpus(tmp_path / "corpus.txt", documents)))
    output = tmp_path / "out"
    request = PrepareRequest(corpus=corpus, locations=(Location(str(output)),), vocab_size=300, shard_tokens=2000)
    with pytest.raises(Interrupted):
        prepare_dataset(request, progress=InterruptAfterShards(3))
    assert not (output / "index.json").exists()  # unfinished: nothing may trust it
    finished = read_progress(output).train
    assert [shard.name for shard in finished] == ["train-00000.bin", "train-00001.bin", "train-00002.bin"]
    before = {shard.name: (output / shard.name).stat() for shard in finished}

    prepared = prepare_dataset(request)
    assert prepared.shards_reused == 3 and prepared.shards_made == len(prepared.index.train) - 3
    for name, stat in before.items():  # the same files, untouched
        assert (output / name).stat().st_ino == stat.st_ino and (output / name).stat().st_mtime_ns == stat.st_mtime_ns
    assert not (output / PROGRESS_NAME).exists()
    check_dataset(output, documents)

    # an uninterrupted run with the same tokenizer makes the very same shards
    clean = tmp_path / "clean"
    prepare_dataset(
        PrepareRequest(
            corpus=corpus,
            locations=(Location(str(clean)),),
            tokenizer=str(output / "tokenizer.json"),
            shard_tokens=2000,
        )
    )
    assert read_dataset(clean)[0] == prepared.index


def bucket_files(s3, prefix: str) -> dict[str, bytes]:
    """The objects under ``prefix``, by name relative to it."""
    filesystem = s3.filesystem()
    return {path.removeprefix(prefix + "/"): filesystem.cat_file(path) for path in filesystem.find(prefix)}


def test_prepare_to_s3_resumes_after_a_kill_mid_upload(tmp_path, s3):
    """A ``diloco prepare`` process killed while uploading (through a slow link) leaves no
    index; run again, it keeps the staged shards and the files already uploaded, and finishes."""
    documents = make_documents(500, seed=3)
    corpus = write_text_corpus(tmp_path / "corpus.txt", documents)
    bucket = s3.create_bucket("prepare-resume")
    work = tmp_path / "work"
    command = [
        "prepare",
        str(corpus),
        "-o",
        f"{bucket}/shakespeare",
        "--vocab-size",
        "300",
        "--shard-tokens",
        "1500",
        "--work-dir",
        str(work),
    ]
    host, port = s3.endpoint_url.removeprefix("http://").split(":")
    with delay_proxy((host, int(port)), 0.05) as proxy:
        environment = {**os.environ, "AWS_ENDPOINT_URL": f"http://{proxy.host}:{proxy.port}"}
        process = subprocess.Popen(
            [sys.executable, "-m", "diloco_cli", *command],
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        uploaded: list[str] = []
        while len(uploaded) < 3:
            assert process.poll() is None and time.monotonic() < deadline, "prepare ended before it was killed"
            record = bucket_files(s3, "prepare-resume/shakespeare").get("uploads.json")
            uploaded = [file["name"] for file in json.loads(record)["files"]] if record else []
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait()
    in_bucket = bucket_files(s3, "prepare-resume/shakespeare")
    assert "index.json" not in in_bucket and set(uploaded) <= set(in_bucket)
    staged = read_progress(work)
    assert staged.heldout is not None  # tokenizing had finished: uploads come after

    output = prepare(*command[1:])
    shards = len(staged.train)
    assert f"shards: 0 made, {shards} kept from an earlier run" in output
    skipped = int(output.split("uploads: ")[1].split(" files")[0])
    assert skipped >= len(uploaded)
    in_bucket = bucket_files(s3, "prepare-resume/shakespeare")
    index = DatasetIndex.model_validate_json(in_bucket.pop("index.json"))
    assert set(in_bucket) == {
        "tokenizer.json",
        "heldout.bin",
        *(entry.name for entry in index.train),
    }  # no records left
    assert_matches_index(index, in_bucket)
    assert decoded_documents(index, in_bucket, in_bucket["tokenizer.json"], 0.01) == documents
    assert not work.exists()  # the staging directory goes once every location is complete


def test_a_second_tokenizer_is_refused_in_the_same_output(tmp_path):
    documents = make_documents(200, seed=4)
    corpus = str(write_text_corpus(tmp_path / "corpus.txt", documents))
    prepare(corpus, "-o", str(tmp_path / "first"), "--vocab-size", "300")
    prepare(corpus, "-o", str(tmp_path / "second"), "--vocab-size", "280")
    index_before = (tmp_path / "first" / "index.json").read_bytes()

    again = prepare(corpus, "-o", str(tmp_path / "first"), "--vocab-size", "300")
    assert "already complete, nothing to do" in again

    refused = runner.invoke(
        app,
        ["prepare", corpus, "-o", str(tmp_path / "first"), "--tokenizer", str(tmp_path / "second" / "tokenizer.json")],
    )
    assert refused.exit_code == 2
    message = refused.stderr.strip()
    assert message.count("\n") == 0 and message.startswith("error: ")
    assert "already holds a dataset made with another tokenizer" in message and "--overwrite" in message
    assert (tmp_path / "first" / "index.json").read_bytes() == index_before

    prepare(
        corpus, "-o", str(tmp_path / "first"), "--tokenizer", str(tmp_path / "second" / "tokenizer.json"), "--overwrite"
    )
    assert (
        check_dataset(tmp_path / "first", documents).tokenizer_sha256
        == read_dataset(tmp_path / "second")[0].tokenizer_sha256
    )


def test_regions_get_one_copy_each_in_their_own_bucket(tmp_path, s3):
    documents = make_documents(150, seed=5)
    corpus = write_text_corpus(tmp_path / "plays.txt", documents)
    east, west = s3.create_bucket("data-east"), s3.create_bucket("data-west")
    options = {"endpoint_url": s3.endpoint_url}
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {"name": "east", "bucket": f"{east}/runs", "storage_options": options},
                {
                    "name": "west",
                    "bucket": west,
                    "storage_options": options,
                    "data_source": f"{west}/tokens/plays.json",
                    "data_storage_options": options,
                },
            ]
        },
    )
    output = prepare(
        str(corpus),
        "--regions",
        str(regions),
        "--vocab-size",
        "300",
        "--shard-tokens",
        "2000",
        "--work-dir",
        str(tmp_path / "work"),
    )
    east_index, west_index = f"{east}/runs/datasets/plays/index.json", f"{west}/tokens/plays.json"
    assert f"index: {east_index}" in output and f"index: {west_index}" in output
    east_files, west_files = bucket_files(s3, "data-east/runs/datasets/plays"), bucket_files(s3, "data-west/tokens")
    assert east_files.pop("index.json") == west_files.pop("plays.json")
    assert east_files == west_files
    assert set(s3.filesystem().ls("data-west")) == {"data-west/tokens"}  # nothing outside the region's data prefix
    batches = []
    for index_url in (east_index, west_index):
        with TokenBatches(
            index_url, options, shard=1, num_shards=2, rank=0, world_size=1, chunk_bytes=4096, cache_bytes=65536
        ) as stream:
            batches.append(stream.batch_at(7, 4, 32)[0])
    assert batches[0].equal(batches[1])


@pytest.mark.parametrize(
    ("corpus_name", "content", "arguments", "expected"),
    [
        (
            "c.jsonl",
            '{"body": "x"}\n',
            ["--vocab-size", "300"],
            "has no text in 'text' (keys: body); name the key with --text-field",
        ),
        ("c.parquet", "", ["--vocab-size", "300"], "needs pyarrow: pip install 'diloco-cli[parquet]'"),
        ("c.txt", "a\n\nb\n\nc", ["--vocab-size", "100"], "--vocab-size 100 is too small"),
        ("c.txt", "a\n\nb\n\nc", [], "give a tokenizer (--tokenizer tokenizer.json), or --vocab-size N"),
        ("c.txt", "only one document", ["--vocab-size", "300"], "leaves no training tokens"),
        ("missing.txt", None, ["--vocab-size", "300"], "no such file"),
    ],
)
def test_mistakes_are_one_line_and_say_what_to_do(tmp_path, monkeypatch, corpus_name, content, arguments, expected):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    if content is not None:
        (tmp_path / corpus_name).write_text(content)
    result = runner.invoke(app, ["prepare", str(tmp_path / corpus_name), "-o", str(tmp_path / "out"), *arguments])
    assert result.exit_code == 2, result.output
    *progress, error = result.stderr.splitlines()
    assert error.startswith("error: ") and expected in error and "Traceback" not in result.output
