"""Streaming token datasets at their limits: read-ahead that hides a slow bucket (moto behind
the delaying proxy), and a learner process under a memory limit below the corpus size that
streams a whole range."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np

from diloco_cli.data.tokens.existing import index_existing
from diloco_cli.data.tokens.storage import Location
from diloco_cli.data.tokens.stream import TokenBatches
from testbed.delay_proxy import delay_proxy
from tests.support.token_windows import golden_batch, process_tokens


def test_read_ahead_hides_the_latency_of_a_slow_bucket(tmp_path, s3):
    """Through a proxy that delays every request and answer by 0.1 s, a chunk costs at
    least 0.2 s to read; once read-ahead is warm, a batch costs less than one delay."""
    delay, batch_size, sequence_length = 0.1, 8, 64
    bucket = s3.create_bucket("slow-tokens")
    tokens = np.random.default_rng(4).integers(0, 50000, 200_000, dtype=np.uint16)
    s3.filesystem().pipe(
        {"slow-tokens/ds/train.bin": tokens[:150_000].tobytes(), "slow-tokens/ds/val.bin": tokens[150_000:].tobytes()}
    )
    index_existing(Location(f"{bucket}/ds", {"endpoint_url": s3.endpoint_url}), dtype="uint16", vocab_size=50000)
    chunk_bytes = 2 * batch_size * sequence_length * 2  # a new chunk every second step
    host, port = s3.endpoint_url.removeprefix("http://").split(":")
    with delay_proxy((host, int(port)), delay) as proxy:
        options = {"endpoint_url": f"http://{proxy.host}:{proxy.port}"}
        with TokenBatches(
            f"{bucket}/ds/index.json",
            options,
            shard=0,
            num_shards=1,
            rank=0,
            world_size=1,
            chunk_bytes=chunk_bytes,
            cache_bytes=16 * chunk_bytes,
            seed=0,
        ) as batches:
            mine = process_tokens(tokens[:150_000], batches.blocks)
            started = time.perf_counter()
            batches.batch_at(0, batch_size, sequence_length)
            cold = time.perf_counter() - started
            warm = []
            for step in range(1, 11):
                time.sleep(0.2)  # the step trains
                started = time.perf_counter()
                inputs, _ = batches.batch_at(step, batch_size, sequence_length)
                warm.append(time.perf_counter() - started)
                assert np.array_equal(inputs.numpy(), golden_batch(mine, step, batch_size, sequence_length)[:, :-1])
            started = time.perf_counter()
            batches.batch_at(500, batch_size, sequence_length)  # a resume far ahead: nothing read yet
            seek = time.perf_counter() - started
    assert cold >= 2 * delay and seek >= 2 * delay
    assert max(warm) < delay, warm


MEMORY_CHILD = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    import torch
    from diloco_cli.data.tokens.stream import TokenBatches

    def address_space():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    torch.set_num_threads(1)  # torch's own pool reserves a stack per core, which on a many-core machine is the limit
    index, corpus_bytes, headroom = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    limit = address_space() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        np.empty(corpus_bytes, dtype=np.uint8).fill(1)
        print("the limit does not bind", flush=True)
        sys.exit(1)
    except MemoryError:
        pass
    batch_size, sequence_length = 64, 1024
    with TokenBatches(
        index, {}, shard=0, num_shards=1, rank=0, world_size=1, chunk_bytes=4 << 20, cache_bytes=32 << 20, seed=0
    ) as batches:
        steps = (batches.blocks.tokens - 1) // sequence_length // batch_size
        total = 0
        for step in range(steps):
            inputs, _ = batches.batch_at(step, batch_size, sequence_length)
            total += int(inputs.sum())
    print(steps, total, batches.blocks.block_tokens, *batches.blocks.blocks)
    """
)


def test_streaming_a_range_larger_than_the_memory_limit(tmp_path):
    """A learner under an address-space limit of its start-up size plus 128 MB (less than
    the 201 MB shard) streams its whole range and sums its tokens right."""
    directory = tmp_path / "big"
    directory.mkdir()
    cycle = np.arange(65521, dtype=np.uint16).tobytes()  # token i is i % 65521
    with open(directory / "train.bin", "wb") as handle:
        for _ in range(1536):
            handle.write(cycle)
    count = 1536 * 65521
    np.arange(1000, dtype=np.uint16).tofile(directory / "val.bin")
    index_existing(Location(str(directory)), dtype="uint16", vocab_size=65521)
    environment = {
        **os.environ,
        "MALLOC_ARENA_MAX": "2",
    }  # glibc would reserve 64 MB of address space per reading thread
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, str(directory / "index.json"), str(2 * count), str(128 << 20)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    steps, total, block_tokens, *blocks = map(int, result.stdout.split())

    def below(position: int) -> int:  # the sum of the stream's tokens [0, position): token i is i % 65521
        full, rest = divmod(position, 65521)
        return full * (65520 * 65521 // 2) + rest * (rest - 1) // 2

    used = steps * 64 * 1024  # the inputs of every window the steps took: the process's first `used` tokens
    expected = 0
    for number, block in enumerate(blocks):
        take = min(block_tokens, used - number * block_tokens)
        if take <= 0:
            break
        expected += below(block * block_tokens + take) - below(block * block_tokens)
    assert steps > 1500 and total == expected
