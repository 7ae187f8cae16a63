"""Benchmark: tokens per second the streaming loader delivers from a slow bucket and from disk.

The same token dataset (random uint16 ids written with numpy in 16 MB shards, indexed
as ``diloco prepare --existing`` does) lies on local disk and in a moto S3 bucket that is read
through ``testbed/delay_proxy.py`` adding 50 ms each way (a request costs a 100 ms round
trip), both as processes of their own.  One learner streams its whole range with
:class:`~diloco_cli.data.tokens.stream.TokenBatches` at the default recipe's settings
(4 MB chunks, a 64 MB cache, batches of 16 x 128 tokens): after its first batch and a
moment for the read-ahead to start, the time to take every batch of the range in order
is the loader's rate, tokens per second; medians of repeats, each from a fresh loader.
A batch that takes over 10 ms counts as a stall (it waited for a read).
Beside it: the bytes that crossed the proxy per byte of the range (each byte is read
about once); the link's ceiling, the bare ranged reads of the range through the proxy,
as many at once as the loader reads ahead and nobody consuming them (what moto and the
proxy can deliver on this machine at all); and the tokens per second the default
0.84M-parameter model consumes here (AdamW inner steps of that batch on one thread).

Targets: the bucket's rate at least 0.8x the disk's once read-ahead is warm, and at
least 20x what the model consumes.

    python -m bench.data            # 256 MB of tokens, 5 repeats (about 2 minutes)
    python -m bench.data --quick    # 32 MB, 2 repeats (the test suite)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench._common import benchmark_parser, median, print_table, write_and_report
from diloco_cli.config.recipe import Recipe
from diloco_cli.data.tokens.existing import index_existing
from diloco_cli.data.tokens.storage import Location
from diloco_cli.data.tokens.stream import READ_AHEAD_CHUNKS, ShardReader, TokenBatches
from diloco_cli.training.inner import inner_step, make_inner_optimizer

REPOSITORY = Path(__file__).resolve().parent.parent
TARGETS = {"bucket_vs_disk": 0.8, "loader_vs_model": 20.0}
DELAY_MS = 50
SHARD_MEGABYTES = 16
"""About the size of the shards ``diloco prepare`` makes (10M tokens); moto also copies
a whole object to answer each ranged read of it, so a big object would measure moto."""
READ_AHEAD_START_SECONDS = 0.5
"""The pause after the first batch, as a first training step would give the read-ahead."""
STALL_SECONDS = 0.01
"""A batch that takes longer waited for a chunk (a read costs at least a 100 ms round trip)."""


def write_dataset(directory: Path, megabytes: int) -> int:
    """Training shards of :data:`SHARD_MEGABYTES` of random uint16 ids (``megabytes`` in
    all), ``val.bin`` and the index; returns the training bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for number in range(megabytes // SHARD_MEGABYTES):
        rng.integers(0, 50_000, SHARD_MEGABYTES << 19, dtype=np.uint16).tofile(directory / f"train-{number:05d}.bin")
    rng.integers(0, 50_000, 1 << 16, dtype=np.uint16).tofile(directory / "val.bin")
    return index_existing(Location(str(directory)), dtype="uint16", vocab_size=50_000).train_tokens * 2


def stream_rate(
    index_url: str, storage_options: dict, batch_size: int, sequence_length: int, chunk_bytes: int, cache_bytes: int
) -> dict:
    """Tokens per second of a fresh loader through its whole range, read-ahead started,
    and its stalls: batches that took longer than :data:`STALL_SECONDS` (they waited for
    a chunk)."""
    with TokenBatches(
        index_url,
        storage_options,
        shard=0,
        num_shards=1,
        rank=0,
        world_size=1,
        chunk_bytes=chunk_bytes,
        cache_bytes=cache_bytes,
        seed=0,
    ) as batches:
        steps = (batches.blocks.tokens - 1) // sequence_length // batch_size
        batches.batch_at(0, batch_size, sequence_length)
        time.sleep(READ_AHEAD_START_SECONDS)
        stalls = []
        started = last = time.perf_counter()
        for step in range(1, steps):
            batches.batch_at(step, batch_size, sequence_length)
            now = time.perf_counter()
            if now - last > STALL_SECONDS:
                stalls.append(now - last)
            last = now
        rate = (steps - 1) * batch_size * sequence_length / (last - started)
    return {"tokens_per_second": rate, "stalled_batches": len(stalls), "stall_seconds": sum(stalls)}


def link_ceiling(index_url: str, storage_options: dict, chunk_bytes: int) -> float:
    """Tokens per second of the bare ranged reads of the range, chunk by chunk, as many at
    once as the loader reads ahead, with nobody consuming them: what the link (and moto
    behind it) can deliver at all."""
    reader = ShardReader(index_url, storage_options, None)
    chunk_tokens = chunk_bytes // reader.index.item_bytes
    pieces = [
        (shard.name, start, min(start + chunk_tokens, shard.tokens))
        for shard in reader.index.train
        for start in range(0, shard.tokens, chunk_tokens)
    ]
    started = time.perf_counter()
    with ThreadPoolExecutor(READ_AHEAD_CHUNKS) as pool:
        list(pool.map(lambda piece: len(reader.read(*piece)), pieces))
    return reader.index.train_tokens / (time.perf_counter() - started)


def model_rate(batch_size: int, sequence_length: int, steps: int) -> float:
    """Tokens per second the default recipe's model trains on (one thread)."""
    recipe = Recipe()
    torch.manual_seed(0)
    model = recipe.model.build()
    optimizer = make_inner_optimizer(
        model, recipe.training.learning_rate, recipe.training.weight_decay, recipe.training.betas
    )
    tokens = torch.randint(0, 256, (batch_size, sequence_length + 1))
    seconds = []
    for step in range(steps + 2):
        started = time.perf_counter()
        inner_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], recipe.training.learning_rate)
        if step >= 2:  # the first steps allocate
            seconds.append(time.perf_counter() - started)
    return batch_size * sequence_length / median(seconds)


def start_delay_proxy(endpoint_url: str, stats: Path) -> tuple[subprocess.Popen, str]:
    """``python -m testbed.delay_proxy`` in front of ``endpoint_url``; its process and URL."""
    upstream = endpoint_url.removeprefix("http://")
    command = [
        sys.executable,
        "-m",
        "testbed.delay_proxy",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        upstream,
        "--delay-ms",
        str(DELAY_MS),
        "--stats",
        str(stats),
    ]
    process = subprocess.Popen(command, cwd=REPOSITORY, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline().split()
    if line[:1] != ["listening"]:
        process.kill()
        raise RuntimeError(f"the delay proxy did not start: {line}")
    return process, f"http://{line[1]}"


def proxied_bytes(stats: Path) -> int:
    """The bytes the proxy has sent its clients, once its counts have caught up (it
    writes them every 0.1 s)."""
    time.sleep(0.3)
    return json.loads(stats.read_text())["bytes_to_client"]


def measure(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPOSITORY))
    from testbed.servers import moto_s3_server, stop_process

    torch.set_num_threads(1)
    batch_size, sequence_length = Recipe().training.batch_size, Recipe().data.sequence_length
    data = Recipe().data
    chunk_bytes, cache_bytes = int(data.chunk_megabytes * 2**20), int(data.cache_megabytes * 2**20)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-data-") as work, moto_s3_server() as server:
        local = Path(work) / "tokens"
        range_bytes = write_dataset(local, args.megabytes)
        bucket = server.create_bucket("bench-tokens")
        server.filesystem().put(str(local) + "/", "bench-tokens/tokens/", recursive=True)
        stats = Path(work) / "proxy.json"
        proxy, proxy_url = start_delay_proxy(server.endpoint_url, stats)
        try:
            bucket_source = f"S3 (moto) +{DELAY_MS} ms each way"
            sources = {
                "local disk": (str(local / "index.json"), {}),
                bucket_source: (f"{bucket}/tokens/index.json", {**server.storage_options, "endpoint_url": proxy_url}),
            }
            ceilings = []
            for repeat in range(args.repeats):
                for source, (index_url, options) in sources.items():
                    before = proxied_bytes(stats)
                    measured = stream_rate(index_url, options, batch_size, sequence_length, chunk_bytes, cache_bytes)
                    crossed = proxied_bytes(stats) - before
                    rows.append(
                        {
                            "source": source,
                            "repeat": repeat,
                            **measured,
                            "link_bytes_per_range_byte": crossed / range_bytes,
                        }
                    )
                ceilings.append(link_ceiling(*sources[bucket_source], chunk_bytes))
        finally:
            stop_process(proxy)
    local_rate = median([row["tokens_per_second"] for row in rows if row["source"] == "local disk"])
    bucket_rows = [row for row in rows if row["source"] != "local disk"]
    bucket_rate = median([row["tokens_per_second"] for row in bucket_rows])
    model = model_rate(batch_size, sequence_length, args.model_steps)
    return {
        "rows": rows,
        "local_tokens_per_second": local_rate,
        "bucket_tokens_per_second": bucket_rate,
        "bucket_link_bytes_per_range_byte": median([row["link_bytes_per_range_byte"] for row in bucket_rows]),
        "link_ceiling_tokens_per_second": median(ceilings),
        "bucket_vs_link_ceiling": bucket_rate / median(ceilings),
        "model_tokens_per_second": model,
        "bucket_vs_disk": bucket_rate / local_rate,
        "loader_vs_model": bucket_rate / model,
    }


def verdicts(results: dict) -> dict:
    return {
        name: {"measured": results[name], "target": target, "met": results[name] >= target}
        for name, target in TARGETS.items()
    }


def main(argv: list[str] | None = None) -> dict:
    args = benchmark_parser(__doc__, "a small run for the test suite (~30 seconds)").parse_args(argv)
    args.megabytes = 32 if args.quick else 256
    args.repeats = 2 if args.quick else 5
    args.model_steps = 3 if args.quick else 20
    results = measure(args)
    results["targets"] = verdicts(results)
    data = Recipe().data
    settings = {
        "dataset_megabytes": args.megabytes,
        "repeats": args.repeats,
        "delay_ms_each_way": DELAY_MS,
        "batch_size": Recipe().training.batch_size,
        "sequence_length": data.sequence_length,
        "chunk_megabytes": data.chunk_megabytes,
        "cache_megabytes": data.cache_megabytes,
        "model_steps": args.model_steps,
        "threads": 1,
    }
    print_table(
        results["rows"],
        ["source", "repeat", "tokens_per_second", "stalled_batches", "stall_seconds", "link_bytes_per_range_byte"],
    )
    print(
        f"bare ranged reads through the proxy: {results['link_ceiling_tokens_per_second']:.4g} tokens/s; "
        f"the loader takes {results['bucket_vs_link_ceiling']:.2f} of it"
    )
    print(f"model consumes {results['model_tokens_per_second']:.4g} tokens/s")
    for name, verdict in results["targets"].items():
        print(
            f"{name}: {verdict['measured']:.3f} (target >= {verdict['target']}) {'met' if verdict['met'] else 'MISSED'}"
        )
    write_and_report("data", args, settings, results)
    return results


if __name__ == "__main__":
    main()
