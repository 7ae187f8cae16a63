"""Benchmark: one learner of several processes (torchrun: DDP or FSDP2 over nccl), bf16, compiled.

Started under torchrun, one process per GPU (``bench/gpu_check.py`` starts it)::

    torchrun --standalone --nproc-per-node=N -m bench.gpu_distributed --parallelism fsdp --compile --output F
    torchrun --standalone --nproc-per-node=2 -m bench.gpu_distributed --device cpu --quick --output F  # gloo

Every rank sets up the Llama recipe's model (``recipes/llama-small.yaml``: 110M
parameters, context 1024) as a learner does (``build_model``: under FSDP2 built on the
meta device and sharded, never whole), installs rank 0's full fp32 weights into it (a
learner's first act), then times inner steps on its share of the recipe's batch, in the
recipe's micro-batches, under bf16 autocast.  It measures its peak memory after setting
up and after training: the GPU's (``torch.cuda.max_memory_allocated``), or on a CPU the
process's resident memory above its start.  Rank 0 writes tokens per second (all ranks
together), MFU per device (bench.gpu's FLOPs per token against its peak), each rank's
peak memory, and whether an install then a gather gives back rank 0's values bit for bit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench._common import benchmark_parser, write_result
from bench.gpu import LEARNING_RATE, peak_bf16_flops, synchronize
from diloco_cli.config.files import load_recipe
from diloco_cli.config.recipe import ModelConfig
from diloco_cli.runtime.distributed import (
    ProcessGroup,
    build_model,
    choose_device,
    full_parameters,
    install_parameters,
    join_process_group,
    leave_process_group,
    parameters_on_meta,
)
from diloco_cli.training.inner import inner_step, make_inner_optimizer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "llama-small.yaml"
TINY_MODEL = ModelConfig(factory="diloco_cli.models.hf:causal_lm", kwargs={"config": "builtin:tiny-llama"})


def resident(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakMemory:
    """The most memory this rank held since it was made: the GPU's allocations, or the
    process's resident memory above what it held when made (the kernel's high-water mark,
    reset at the start)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.start = 0
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.start = resident("VmRSS")

    def bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return resident("VmHWM") - self.start


def shape(quick: bool) -> dict[str, Any]:
    """The model and the work: the Llama recipe's, or a tiny Llama's for ``quick``."""
    recipe = load_recipe(RECIPE)
    if quick:
        return {"model": TINY_MODEL, "batch": 8, "micro_batch": 2, "sequence": 32, "steps": 3, "warmup": 1}
    training = recipe.training
    return {
        "model": recipe.model,
        "batch": training.batch_size,
        "micro_batch": training.micro_batch_size,
        "sequence": recipe.data.sequence_length,
        "steps": 30,
        "warmup": 5,
    }


def flops_per_token(model: torch.nn.Module, sequence: int) -> float:
    """bench.gpu's count on a Hugging Face model's config: 6 x the weights of every matrix
    multiply (the tied head included, once) plus attention's 12 L d T."""
    config = model.config
    linear = sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))
    head = config.vocab_size * config.hidden_size if getattr(config, "tie_word_embeddings", False) else 0
    return 6 * (linear + head) + 12 * config.num_hidden_layers * config.hidden_size * sequence


def timed_steps(
    step: Callable[[int], float], work: dict[str, Any], device: torch.device, group: ProcessGroup
) -> tuple[float, list[float], float]:
    """The warm-up steps' seconds, then the measured steps' losses and seconds (every rank
    starting them together)."""
    started = time.perf_counter()
    for index in range(work["warmup"]):
        step(index)
    synchronize(device)
    warmup_seconds = time.perf_counter() - started
    if group.distributed:
        dist.barrier()
    started = time.perf_counter()
    losses = [step(index) for index in range(work["steps"])]
    synchronize(device)
    return warmup_seconds, losses, time.perf_counter() - started


def result_of(
    parallelism: str,
    compile: bool,
    device: torch.device,
    group: ProcessGroup,
    work: dict[str, Any],
    model: torch.nn.Module,
    parameters: int,
    exact: bool,
    timings: dict[str, Any],
    records: list[dict[str, Any]],
) -> dict[str, Any]:
    """The storage rank's row: speed, MFU, losses, whether installs were exact and every
    rank's peak memory."""
    elapsed, losses, warmup_seconds = timings["elapsed"], timings["losses"], timings["warmup_seconds"]
    tokens_per_second = work["steps"] * work["batch"] * work["sequence"] / elapsed
    peak_flops = peak_bf16_flops(device)
    per_device = flops_per_token(model, work["sequence"]) * tokens_per_second / group.world_size
    return {
        "parallelism": parallelism if group.distributed else "one process",
        "processes": group.world_size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "compiled": compile,
        "parameters": parameters,
        "model_MB": 4 * parameters / 2**20,
        "batch": work["batch"],
        "micro_batch": work["micro_batch"],
        "sequence": work["sequence"],
        "steps": work["steps"],
        "warmup_seconds": warmup_seconds,
        "step_ms": 1000 * elapsed / work["steps"],
        "tokens_per_second": tokens_per_second,
        "MFU": per_device / peak_flops if peak_flops else None,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "installs_bit_exact": exact,
        "peak_memory_MB": [
            {
                "rank": r["rank"],
                "setup": r["setup_peak_bytes"] / 2**20,
                "training": r["training_peak_bytes"] / 2**20,
            }
            for r in records
        ],
    }


def run(parallelism: str, compile: bool, device: torch.device, quick: bool) -> dict[str, Any] | None:
    group = join_process_group(device)
    work = shape(quick)
    model_config: ModelConfig = work["model"]
    if group.is_storage_rank:
        torch.manual_seed(0)
        values = {name: p.detach() for name, p in model_config.build().named_parameters()}
    else:
        values = None
    with parameters_on_meta():  # every rank imports the model's code before its memory is counted
        model_config.build()
    peak = PeakMemory(device)
    model, prepared = build_model(model_config.build, device, group, parallelism, compile)
    names = [name for name, _ in model.named_parameters()]
    install_parameters(model, values, names, group)
    synchronize(device)
    setup_peak = peak.bytes()
    back = full_parameters(model, names, group)
    exact = group.is_storage_rank and all(torch.equal(back[name], values[name]) for name in names)
    del back
    optimizer = make_inner_optimizer(model, LEARNING_RATE, 0.1, (0.9, 0.95))
    rank_batch = work["batch"] // group.world_size
    vocabulary = model.config.vocab_size
    generator = torch.Generator(device=device).manual_seed(group.rank)
    rows = torch.randint(0, vocabulary, (4, rank_batch, work["sequence"] + 1), device=device, generator=generator)

    def step(index: int) -> float:
        batch = rows[index % len(rows)]
        return inner_step(
            prepared,
            optimizer,
            batch[:, :-1],
            batch[:, 1:],
            LEARNING_RATE,
            1.0,
            micro_batch_size=work["micro_batch"],
            precision="bf16",
        )

    warmup_seconds, losses, elapsed = timed_steps(step, work, device, group)
    record = {"rank": group.rank, "setup_peak_bytes": setup_peak, "training_peak_bytes": peak.bytes()}
    records = [record]
    if group.distributed:
        records = [None] * group.world_size
        dist.all_gather_object(records, record)
    parameters = sum(value.numel() for value in values.values()) if values else 0
    if group.distributed:
        dist.barrier()  # every rank done with every collective before any leaves
    leave_process_group(group)
    if not group.is_storage_rank:
        return None
    timings = {"warmup_seconds": warmup_seconds, "elapsed": elapsed, "losses": losses}
    return result_of(parallelism, compile, device, group, work, model, parameters, exact, timings, records)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = benchmark_parser(__doc__, "a tiny Llama, a few steps (for the test suite)")
    parser.add_argument("--parallelism", choices=["ddp", "fsdp"], default="fsdp")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (each block under FSDP2)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    device = choose_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    results = run(args.parallelism, args.compile, device, args.quick)
    if results is not None:
        name = f"gpu-{args.parallelism}"
        settings = {"parallelism": args.parallelism, "compile": args.compile, "device": args.device}
        path = write_result(name, args.quick, settings, results, args.output)
        peaks = ", ".join(f"{peak['training']:.0f} MB" for peak in results["peak_memory_MB"])
        print(
            f"{results['parallelism']} x{results['processes']}: {results['tokens_per_second']:.4g} tokens/s, "
            f"peak memory per rank {peaks}; wrote {path}"
        )
    return results


if __name__ == "__main__":
    main()
