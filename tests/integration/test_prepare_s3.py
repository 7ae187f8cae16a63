"""``diloco prepare`` into S3 (moto): a process killed mid-upload resumes, and every region
gets one copy in its own bucket. Every dataset is checked as in tests/unit/test_prepare.py."""

import json
import os
import signal
import subprocess
import sys
import time

from diloco_cli.data.tokens.index import DatasetIndex
from diloco_cli.data.tokens.shards import read_progress
from diloco_cli.data.tokens.stream import TokenBatches
from testbed.delay_proxy import delay_proxy
from tests.support.corpora import (
    assert_matches_index,
    decoded_documents,
    make_documents,
    prepare,
    write_text_corpus,
)
from tests.support.runs import write_yaml


def bucket_files(s3, prefix: str) -> dict[str, bytes]:
    """The objects under ``prefix``, by name relative to it."""
    filesystem = s3.filesystem()
    return {path.removeprefix(prefix + "/"): filesystem.cat_file(path) for path in filesystem.find(prefix)}


def read_if_there(s3, path: str) -> bytes | None:
    """The object at ``path``, or None before it exists. (Polled while a writer starts, a
    ``find`` of the prefix can list nothing and then find the prefix itself as a "directory",
    which s3fs returns as one entry named like the prefix.)"""
    try:
        return s3.filesystem().cat_file(path)
    except FileNotFoundError:
        return None


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
            record = read_if_there(s3, "prepare-resume/shakespeare/uploads.json")
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
            index_url,
            options,
            shard=1,
            num_shards=2,
            rank=0,
            world_size=1,
            chunk_bytes=4096,
            cache_bytes=65536,
            seed=0,
        ) as stream:
            batches.append(stream.batch_at(7, 4, 32)[0])
    assert batches[0].equal(batches[1])


def test_an_s3_output_takes_storage_options_as_a_region_file_does(tmp_path, s3, monkeypatch):
    """``-o s3://...`` of an S3-compatible store named by ``--storage-options`` alone (no
    ``AWS_ENDPOINT_URL``), and the index read back with the same options."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    documents = make_documents(150, seed=8)
    corpus = write_text_corpus(tmp_path / "notes.txt", documents)
    bucket = s3.create_bucket("data-options")
    options = {"endpoint_url": s3.endpoint_url}
    output = prepare(
        str(corpus),
        "-o",
        f"{bucket}/notes",
        "--storage-options",
        json.dumps(options),
        "--vocab-size",
        "300",
        "--work-dir",
        str(tmp_path / "work"),
    )
    assert f"index: {bucket}/notes/index.json" in output
    files = bucket_files(s3, "data-options/notes")
    index = DatasetIndex.model_validate_json(files.pop("index.json"))
    assert_matches_index(index, files)
    assert decoded_documents(index, files, files["tokenizer.json"], 0.01) == documents
