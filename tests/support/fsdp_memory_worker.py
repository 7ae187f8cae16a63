"""One rank of a 2-process FSDP2 learner, measuring the memory its model takes to set up,
for tests/integration/test_fsdp_memory.py.

Started as ``python -m tests.support.fsdp_memory_worker --out DIR --layout LAYOUT`` with
torchrun's environment.  Every rank resets its peak resident memory, builds the model
(``meta``: the learner's :func:`build_model`; ``whole``: built whole, then sharded, as
learners did before), and installs the same full values from rank 0, as a learner
installs the global weights; rank 0 builds those values itself first (a learner's storage
rank holds its bases whole), and every rank imports the model's code, before the peak is
reset.  It records its peak resident
memory above the baseline, its shards and buffers, and the loss of one step.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from diloco_cli.config.recipe import ModelConfig
from diloco_cli.runtime.distributed import (
    build_model,
    choose_device,
    install_parameters,
    join_process_group,
    leave_process_group,
    parameters_on_meta,
    prepare_model,
)
from diloco_cli.training.inner import inner_step, make_inner_optimizer

MODEL = ModelConfig(
    factory="diloco_cli.models.hf:causal_lm",
    kwargs={
        "config": "builtin:tiny-llama",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 8192,
    },
)
"""A Llama of 84M parameters (336 MB in fp32), with rotary frequencies as a buffer."""


def resident(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def full_values() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MODEL.build()
    return {name: parameter.detach() for name, parameter in model.named_parameters()} | {
        f"buffer/{name}": buffer for name, buffer in model.named_buffers()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layout", choices=["meta", "whole"], required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = choose_device("cpu", int(os.environ["LOCAL_RANK"]))
    group = join_process_group(device)
    try:
        values = full_values() if group.is_storage_rank else None
        with parameters_on_meta():  # every rank imports the model's code (tens of MB) before the baseline
            MODEL.build()
        torch.distributed.barrier()
        reset_peak()
        baseline = resident("VmRSS")
        if args.layout == "meta":
            model, prepared = build_model(MODEL.build, device, group, "fsdp", compile=False)
        else:
            torch.manual_seed(0)
            model = MODEL.build()
            prepared = prepare_model(model, device, group, "fsdp", compile=False)
        names = [name for name, _ in model.named_parameters()]
        install_parameters(model, values, names, group)
        peak = resident("VmHWM") - baseline
        shards = {
            name: (parameter.to_local() if isinstance(parameter, DTensor) else parameter).detach().clone()
            for name, parameter in model.named_parameters()
        }
        buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
        optimizer = make_inner_optimizer(model, 1e-3, 0.1, (0.9, 0.95))
        rows = torch.randint(0, 8192, (2, 33), generator=torch.Generator().manual_seed(group.rank))
        loss = inner_step(prepared, optimizer, rows[:, :-1], rows[:, 1:], 1e-3, 1.0)
        parameters = sum(parameter.numel() for parameter in model.parameters())
        torch.save({"shards": shards, "buffers": buffers}, args.out / f"{args.layout}-rank{group.rank}.pt")
        record = {"peak": peak, "model_bytes": 4 * parameters, "loss": loss}
        (args.out / f"{args.layout}-rank{group.rank}.json").write_text(json.dumps(record))
    finally:
        leave_process_group(group)


if __name__ == "__main__":
    main()
