"""FSDP2 without a whole model per rank: two gloo processes set up an 84M-parameter Llama
(336 MB in fp32) and install rank 0's values into it, as a learner does at its start.
Built on the meta device and sharded before any memory is taken, each rank's peak
resident memory grows by about half the model (its shards) plus one parameter in flight;
built whole and then sharded, as before, by the whole model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.fsdp_memory_worker import MODEL
from tests.support.ranks import run_ranks

WORLD_SIZE = 2


def set_up(out: Path, layout: str) -> list[dict]:
    # freed tensors go back to the system: the resident set is what is held
    run_ranks(
        "tests.support.fsdp_memory_worker",
        ["--out", str(out), "--layout", layout],
        WORLD_SIZE,
        timeout=300,
        environment={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    )
    return [json.loads((out / f"{layout}-rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


@pytest.mark.slow
def test_each_rank_holds_about_half_the_model_not_all_of_it(tmp_path):
    meta, whole = set_up(tmp_path, "meta"), set_up(tmp_path, "whole")
    model_bytes = meta[0]["model_bytes"]
    for name, records in (("meta", meta), ("whole", whole)):
        print(
            f"{name}: peak resident memory above the baseline per rank: "
            + ", ".join(f"rank {rank} {record['peak'] / 2**20:.0f} MB" for rank, record in enumerate(records))
            + f" (model {model_bytes / 2**20:.0f} MB)"
        )
    assert model_bytes > 300 << 20
    largest_parameter = 4 * 8192 * 1024  # the embedding, scattered one parameter at a time
    for record in meta:
        assert record["peak"] < model_bytes / WORLD_SIZE + largest_parameter + (32 << 20), record
    assert all(record["peak"] > 0.95 * model_bytes for record in whole)  # what this replaces

    # the same shards and buffers either way: torch.chunk's rows of rank 0's values, the module's own buffers
    for rank in range(WORLD_SIZE):
        built, reference = (torch.load(tmp_path / f"{layout}-rank{rank}.pt") for layout in ("meta", "whole"))
        assert built["shards"].keys() == reference["shards"].keys() and built["buffers"].keys()
        assert all(torch.equal(built["shards"][n], reference["shards"][n]) for n in reference["shards"])
        assert all(torch.equal(built["buffers"][n], reference["buffers"][n]) for n in reference["buffers"])
    torch.manual_seed(0)
    full = dict(MODEL.build().named_parameters())
    rank0 = torch.load(tmp_path / "meta-rank0.pt")["shards"]
    assert all(torch.equal(rank0[n], full[n].detach().chunk(WORLD_SIZE)[0]) for n in full)
    assert all(record["loss"] == record["loss"] and record["loss"] > 0 for record in meta)  # finite, it trains
