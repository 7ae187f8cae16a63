"""A learner's processes: FSDP2 and DDP train exactly like one process, and what rank 0
gathers, installs and checkpoints is the same whatever the layout.

Two gloo processes (tests/support/fsdp_worker.py) run FSDP2 and then DDP in one process group;
the reference is one process in this test, on the whole batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco_cli.runtime.distributed import (
    full_optimizer_state,
    full_parameters,
    install_parameters,
)
from tests.support.fsdp_worker import (
    ONE_PROCESS,
    STEPS,
    batches,
    bitwise_equal,
    build_model,
    installed_values,
    make_optimizer,
    max_difference,
    record_name,
    train,
)
from tests.support.ranks import run_ranks

WORLD_SIZE = 2
TOLERANCE = 2e-4
"""Largest difference of a parameter after fp32 AdamW steps on the same batches summed in
another order (shards, micro-batches): Adam divides each gradient by its own scale, so
the rounding of a gradient near zero moves its parameter by up to a fraction of the
learning rate (1e-2).  One process with and without micro-batches differs by ~7e-5."""
RELATIVE_TOLERANCE = 1e-4
"""Of the whole delta base - theta (relative L2), which a learner sends."""


def launch_ranks(out: Path, parallelisms: list[str], compile: bool) -> dict[str, list[dict]]:
    """Start the worker as WORLD_SIZE ranks with torchrun's environment, wait for them and
    read their records: per parallelism, one per rank."""
    arguments = ["--out", str(out), *(["--compile"] if compile else []), *parallelisms]
    run_ranks("tests.support.fsdp_worker", arguments, WORLD_SIZE, timeout=240)
    return {
        p: [torch.load(out / record_name(p, compile, r), weights_only=True) for r in range(WORLD_SIZE)]
        for p in parallelisms
    }


def relative_delta_error(theta: dict[str, torch.Tensor], reference_theta: dict[str, torch.Tensor]) -> float:
    """|| (base - theta) - (base - reference_theta) || / || base - reference_theta ||, base the initial model."""
    base = dict(build_model().named_parameters())
    error = sum(float((theta[n] - reference_theta[n]).square().sum()) for n in theta)
    size = sum(float((base[n].detach() - reference_theta[n]).square().sum()) for n in theta)
    return (error / size) ** 0.5


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, the whole batches, no micro-batches: the trained parameters and
    AdamW state, then the step after installing the same values."""
    model = build_model()
    optimizer = make_optimizer(model)
    rows = batches()
    losses = [train(model, optimizer, batch, None) for batch in rows[:STEPS]]
    names = [name for name, _ in model.named_parameters()]
    trained = full_parameters(model, names, ONE_PROCESS)
    state = full_optimizer_state(model, optimizer, ONE_PROCESS)
    install_parameters(model, installed_values(model), names, ONE_PROCESS)
    train(model, optimizer, rows[STEPS], None)
    return {"losses": losses, "trained": trained, "state": state, "stepped": full_parameters(model, names, ONE_PROCESS)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    return launch_ranks(tmp_path_factory.mktemp("ranks"), ["fsdp", "ddp"], compile=False)


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["fsdp", "ddp"])
def test_two_processes_train_like_one(parallelism, ranks, reference):
    storage_rank = ranks[parallelism][0]
    # the same parameters after STEPS clipped AdamW steps on half batches in micro-batches,
    # hence the same delta base - theta for the learner to send
    difference = max_difference(storage_rank["trained"], reference["trained"])
    relative = relative_delta_error(storage_rank["trained"], reference["trained"])
    print(
        f"{parallelism}: after {STEPS} steps max |theta_2 processes - theta_1 process| = {difference:.3g}, "
        f"relative error of the delta {relative:.3g}"
    )
    assert difference < TOLERANCE and relative < RELATIVE_TOLERANCE
    for name, entry in reference["state"].items():
        assert float(storage_rank["state"][name]["step"]) == float(entry["step"]) == STEPS
        assert torch.allclose(storage_rank["state"][name]["exp_avg"], entry["exp_avg"], rtol=1e-4, atol=1e-7)
    # each rank's loss is its half's mean: together the whole batch's
    mean_losses = [sum(rank["losses"][step] for rank in ranks[parallelism]) / WORLD_SIZE for step in range(STEPS)]
    assert mean_losses == pytest.approx(reference["losses"], abs=1e-5)
    # only rank 0 receives full tensors
    assert ranks[parallelism][1]["trained"] == {} and ranks[parallelism][1]["state"] == {}


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["fsdp", "ddp"])
def test_installs_and_optimizer_state_are_exact_on_every_rank(parallelism, ranks, reference):
    values = installed_values(build_model())
    storage_rank, other_rank = ranks[parallelism]
    assert bitwise_equal(storage_rank["installed"], values)
    for name, value in values.items():
        shards = [storage_rank["local"][name], other_rank["local"][name]]
        if parallelism == "fsdp":  # FSDP2's layout: torch.chunk along dim 0
            assert all(torch.equal(shard, chunk) for shard, chunk in zip(shards, value.chunk(WORLD_SIZE)))
        else:
            assert all(torch.equal(shard, value) for shard in shards)
    # the checkpoint round trip of AdamW's state is exact
    assert bitwise_equal(storage_rank["state_again"], storage_rank["state"])
    # and both feed the next step: it matches one process's step from the same values
    difference = max_difference(storage_rank["stepped"], reference["stepped"])
    print(f"{parallelism}: max difference one step after the install = {difference:.3g}")
    assert difference < TOLERANCE


@pytest.mark.slow
def test_a_compiled_fsdp_learner_trains_like_one_process(tmp_path, reference):
    """FSDP2 with each block compiled in place before it is sharded: the root keeps its
    type, so micro-batches still skip the gradient sync, and training is unchanged.
    (Compiling DDP or one process is one call on the whole module; it passed here too,
    but each compile costs inductor half a minute on this CPU.)"""
    compiled = launch_ranks(tmp_path, ["fsdp"], compile=True)
    difference = max_difference(compiled["fsdp"][0]["trained"], reference["trained"])
    print(f"fsdp compiled: max |theta_2 processes - theta_1 process| after {STEPS} steps = {difference:.3g}")
    assert difference < TOLERANCE
