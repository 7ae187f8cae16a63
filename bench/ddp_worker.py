"""One rank of synchronous data-parallel training over ``torch.distributed`` (gloo).

The baseline of the WAN benchmark: the recipe's model, data, held-out split, inner AdamW,
schedule and gradient clip, trained by W ranks that all-reduce every step's gradients.
The recipe is loaded as ``diloco up`` loads it (``diloco_cli.config.files.load_recipe``),
and each step is a learner's inner step (``diloco_cli.training.inner``) cut in its two
halves, ``accumulate_gradients`` and ``apply_gradients``, with the all-reduce between.
Rank r plays learner r: it reads shard r of W of the training text with the generator
of a learner's rank 0 (``data_generator(seed, r, 0, 0)``), so its batches are exactly
learner r's, at the learner's batch (``training.batch_size``; the global batch is
W x batch_size, as with M = W learners).  Every rank builds the model after
``torch.manual_seed(training.seed)`` (checked identical by digest before training).

Each step: forward and backward; the gradients are copied into one flat buffer (or
buckets of ``--bucket-mb``) cast to the wire dtype (bf16 by default; gloo sums bfloat16
natively on torch 2.13), all-reduced (SUM) over gloo's ring, cast back to fp32 and
divided by W; then the clip and the AdamW step (``apply_gradients``).  The identical averaged gradient gives
every rank identical parameters (checked by digest at the end).  Per step it records

* ``compute_seconds``: forward + backward + clip + optimizer step,
* ``pack_seconds``: flattening and casting the gradients, and back,
* ``comm_seconds``: the collective itself, timed around it without a barrier, so it also
  holds the wait for the slowest rank to reach it (as in real DDP),
* bytes sent (= received) per rank per the ring model: 2 (W-1)/W x elements x bytes.

With ``--groups G`` (G > 1) the all-reduce is hierarchical, as a region-aware one is: the
ranks form G groups of consecutive ranks (one per region), each group reduces onto its
first rank, the G leaders all-reduce over their own ring, and each leader broadcasts the
sum in its group.  Only the leaders' ring crosses between groups: G x 2 (G-1)/G x
elements x bytes per step (``leader_ring_bytes_per_step``).  The sum is the same (up to
the order of the additions).

Rank 0 evaluates the held-out loss (the syncer's ``evaluation_batches``) at step 0, every
``--eval-every`` steps and after the last step, while the other ranks wait at a barrier;
those pauses are outside ``training_seconds`` (the clock ``--max-seconds`` reads).  With
``--max-seconds S`` training stops after the step in which S seconds of training passed
(every rank learns it from a flag carried by the all-reduce itself, one more element).

    python -m bench.ddp_worker --rank 0 --world-size 4 --master 10.0.0.1:29500 \\
        --steps 300 --out ddp.json --interface veth0 [--recipe FILE] [--set KEY=VALUE]

``bench.ddp_launch.launch_local`` starts W ranks as subprocesses (on loopback by default,
or each behind its own command prefix such as ``ip netns exec NS``) and returns rank 0's JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from diloco_cli.config.files import load_recipe
from diloco_cli.config.recipe import Recipe
from diloco_cli.data.learner import data_generator
from diloco_cli.data.text import TextSplit, evaluation_batches, load_text, random_batch
from diloco_cli.training.inner import (
    InnerSchedule,
    LossFunction,
    accumulate_gradients,
    apply_gradients,
    evaluate,
    make_inner_optimizer,
    resolve_loss,
)

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def ring_bytes(elements: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``elements``."""
    return round(2 * (world_size - 1) / world_size * elements * element_size)


def parameter_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def buckets_of(
    parameters: list[torch.nn.Parameter], bucket_bytes: int, element_size: int
) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters in buckets of at most ``bucket_bytes`` on the wire (a larger
    parameter gets a bucket of its own); 0 puts them all in one bucket."""
    if bucket_bytes <= 0:
        return [parameters]
    buckets: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for parameter in parameters:
        wire = parameter.numel() * element_size
        if buckets[-1] and size + wire > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(parameter)
        size += wire
    return buckets


class GradientReducer:
    """Flat wire-dtype buffers of the gradients, all-reduced and averaged in place."""

    def __init__(
        self, parameters: list[torch.nn.Parameter], dtype: torch.dtype, bucket_bytes: int, world_size: int
    ) -> None:
        self.world_size = world_size
        self.buckets = buckets_of(parameters, bucket_bytes, torch.tensor([], dtype=dtype).element_size())
        # one extra element in the last bucket: the stop flag of --max-seconds
        self.buffers = [
            torch.zeros(sum(p.numel() for p in bucket) + (i == len(self.buckets) - 1), dtype=dtype)
            for i, bucket in enumerate(self.buckets)
        ]

    @property
    def elements(self) -> int:
        return sum(buffer.numel() for buffer in self.buffers)

    def bytes_per_step(self) -> int:
        return sum(ring_bytes(b.numel(), b.element_size(), self.world_size) for b in self.buffers)

    def pack(self, stop: bool) -> None:
        for bucket, buffer in zip(self.buckets, self.buffers):
            offset = 0
            for parameter in bucket:
                n = parameter.numel()
                if parameter.grad is None:
                    buffer[offset : offset + n].zero_()
                else:
                    buffer[offset : offset + n].copy_(parameter.grad.reshape(-1))
                offset += n
        self.buffers[-1][-1] = 1.0 if stop else 0.0

    def all_reduce(self, hierarchy: Hierarchy | None = None) -> None:
        if hierarchy is not None:
            for buffer in self.buffers:
                hierarchy.all_reduce(buffer)
            return
        works = [dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True) for buffer in self.buffers]
        for work in works:
            work.wait()

    def unpack(self) -> bool:
        """Average into the gradients; whether any rank asked to stop."""
        for bucket, buffer in zip(self.buckets, self.buffers):
            averaged = buffer.float().div_(self.world_size)
            offset = 0
            for parameter in bucket:
                n = parameter.numel()
                values = averaged[offset : offset + n].view_as(parameter)
                if parameter.grad is None:
                    parameter.grad = values.clone()
                else:
                    parameter.grad.copy_(values)
                offset += n
        return bool(self.buffers[-1][-1] > 0)


class Hierarchy:
    """A hierarchical all-reduce: groups of consecutive ranks (regions), each reduced onto
    its first rank, the leaders' ring all-reduce, and a broadcast back in each group."""

    def __init__(self, rank: int, world_size: int, groups: int) -> None:
        if world_size % groups:
            raise SystemExit(f"--groups {groups} does not divide --world-size {world_size}")
        size = world_size // groups
        members = [list(range(g * size, (g + 1) * size)) for g in range(groups)]
        made = [dist.new_group(ranks) for ranks in members]  # every rank makes every group, in order
        self.leaders = [ranks[0] for ranks in members]
        self.leader_group = dist.new_group(self.leaders)
        self.rank, self.group, self.leader = rank, made[rank // size], self.leaders[rank // size]

    def all_reduce(self, buffer: torch.Tensor) -> None:
        dist.reduce(buffer, dst=self.leader, op=dist.ReduceOp.SUM, group=self.group)
        if self.rank == self.leader:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.leader_group)
        dist.broadcast(buffer, src=self.leader, group=self.group)


def leader_ring_bytes_per_step(buffers: Sequence[torch.Tensor], groups: int) -> int:
    """Bytes the leaders' ring sends between groups per step (all leaders together)."""
    return groups * sum(ring_bytes(b.numel(), b.element_size(), groups) for b in buffers) if groups > 1 else 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env = os.environ
    parser.add_argument("--rank", type=int, default=int(env.get("RANK", "0")))
    parser.add_argument("--world-size", type=int, default=int(env.get("WORLD_SIZE", "1")))
    default_master = f"{env.get('MASTER_ADDR', '127.0.0.1')}:{env.get('MASTER_PORT', '29500')}"
    parser.add_argument(
        "--master", default=default_master, help="ADDR:PORT of rank 0's rendezvous (default MASTER_ADDR:MASTER_PORT)"
    )
    parser.add_argument(
        "--interface",
        default=env.get("GLOO_SOCKET_IFNAME"),
        help="network interface gloo binds to (sets GLOO_SOCKET_IFNAME)",
    )
    parser.add_argument("--recipe", type=Path, help="recipe YAML (default: the default recipe)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="recipe override, repeatable"
    )
    parser.add_argument(
        "--steps", type=int, help="training steps (default: training.inner_steps); the schedule spans them"
    )
    parser.add_argument(
        "--eval-every", type=int, default=0, help="rank 0 evaluates every E steps (0: only at step 0 and the end)"
    )
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=0.0,
        help="all-reduce buckets of at most this many MB on the wire (0: one buffer)",
    )
    parser.add_argument("--dtype", choices=sorted(WIRE_DTYPES), default="bf16", help="the all-reduce's wire dtype")
    parser.add_argument(
        "--groups",
        type=int,
        default=1,
        help="G > 1: a hierarchical all-reduce over G groups of consecutive ranks (one per region)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--max-seconds", type=float, help="stop after the step in which this many training seconds passed"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds any collective or the rendezvous may take"
    )
    parser.add_argument("--out", type=Path, help="where rank 0 writes its JSON")
    args = parser.parse_args(argv)
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank {args.rank} is not in 0..{args.world_size - 1}")
    return args


@dataclass
class RankSetup:
    """What one rank trains with: the recipe's model, optimizer, schedule, data and loss,
    and the reducer of its gradients."""

    recipe: Recipe
    steps: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: InnerSchedule
    loss_fn: LossFunction
    shard: torch.Tensor
    generator: torch.Generator
    heldout: list[tuple[torch.Tensor, torch.Tensor]]
    reducer: GradientReducer

    @property
    def tokens_per_step(self) -> int:
        return self.reducer.world_size * self.recipe.training.batch_size * self.recipe.data.sequence_length


def set_up(args: argparse.Namespace) -> RankSetup:
    """Rank ``args.rank``'s model (seeded as every rank's), optimizer and data: learner r's
    shard of W and its generator; the held-out batches on rank 0 only."""
    recipe = load_recipe(args.recipe, args.overrides)
    training, data = recipe.training, recipe.data
    steps = args.steps or training.inner_steps
    torch.manual_seed(training.seed)
    model = recipe.model.build()
    split = TextSplit.of(load_text(data.source, data.storage_options), data.heldout_fraction, data.sequence_length)
    heldout = []
    if args.rank == 0:
        heldout = evaluation_batches(
            split.heldout, training.batch_size, data.sequence_length, recipe.sync.evaluation_batches
        )
    parameters = [p for p in model.parameters() if p.requires_grad]
    return RankSetup(
        recipe=recipe,
        steps=steps,
        model=model,
        optimizer=make_inner_optimizer(model, training.learning_rate, training.weight_decay, training.betas),
        schedule=InnerSchedule(
            training.learning_rate, training.warmup_steps, steps, training.final_learning_rate_fraction
        ),
        loss_fn=resolve_loss(training.loss),
        shard=split.share(args.rank, args.world_size, training.seed),  # rank r's share of W, as a learner's
        generator=data_generator(training.seed, args.rank, 0, 0),
        heldout=heldout,
        reducer=GradientReducer(parameters, WIRE_DTYPES[args.dtype], int(args.bucket_mb * 2**20), args.world_size),
    )


def join_group(args: argparse.Namespace, model: torch.nn.Module) -> tuple[str, Hierarchy | None]:
    """Join the gloo group; the initial model's digest (the same on every rank, or exit) and
    the hierarchy of ``--groups``."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.timeout),
    )
    initial = parameter_digest(model)
    initial_digests: list[str] = [""] * args.world_size
    dist.all_gather_object(initial_digests, initial)
    if len(set(initial_digests)) != 1:
        raise SystemExit(f"rank {args.rank}: the ranks' initial models differ: {initial_digests}")
    hierarchy = Hierarchy(args.rank, args.world_size, args.groups) if args.groups > 1 else None
    return initial, hierarchy


@dataclass
class Timeline:
    """What a rank's training took, step by step, and rank 0's evaluations."""

    started: float = field(default_factory=time.perf_counter)
    paused: float = 0.0  # seconds spent in evaluations (and their barrier)
    compute: list[float] = field(default_factory=list)
    pack: list[float] = field(default_factory=list)
    comm: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    steps_done: int = 0
    stopped_by_time: bool = False

    def training_seconds(self) -> float:
        """Seconds since the start, less the evaluations: the clock ``--max-seconds`` reads."""
        return time.perf_counter() - self.started - self.paused


def evaluate_now(setup: RankSetup, rank: int, timeline: Timeline, step: int) -> None:
    """Rank 0 evaluates the held-out loss while the others wait at a barrier; the pause is
    kept out of the training seconds."""
    begin = time.perf_counter()
    if rank == 0:
        loss = evaluate(setup.model, setup.heldout, setup.loss_fn, setup.recipe.training.precision)
        timeline.evaluations.append(
            {
                "step": step,
                "tokens": step * setup.tokens_per_step,
                "loss": loss,
                "seconds": begin - timeline.started,
                "training_seconds": begin - timeline.started - timeline.paused,
            }
        )
        print(f"step {step}: held-out loss {loss:.4f}", flush=True)
    dist.barrier()
    timeline.paused += time.perf_counter() - begin


def train_step(
    setup: RankSetup, args: argparse.Namespace, hierarchy: Hierarchy | None, timeline: Timeline, step: int
) -> bool:
    """One data-parallel step, timed: the learner's inner step in its two halves with the
    all-reduce between; whether any rank asked to stop."""
    training, data, reducer = setup.recipe.training, setup.recipe.data, setup.reducer
    t0 = time.perf_counter()
    inputs, targets = random_batch(setup.shard, training.batch_size, data.sequence_length, setup.generator)
    loss = accumulate_gradients(
        setup.model,
        inputs,
        targets,
        micro_batch_size=training.micro_batch_size,
        precision=training.precision,
        loss_fn=setup.loss_fn,
    )
    t1 = time.perf_counter()
    out_of_time = args.max_seconds is not None and t1 - timeline.started - timeline.paused >= args.max_seconds
    reducer.pack(out_of_time)
    t2 = time.perf_counter()
    reducer.all_reduce(hierarchy)
    t3 = time.perf_counter()
    stop = reducer.unpack()
    t4 = time.perf_counter()
    apply_gradients(setup.model, setup.optimizer, setup.schedule.learning_rate(step - 1), training.gradient_clip)
    t5 = time.perf_counter()
    timeline.compute.append((t1 - t0) + (t5 - t4))
    timeline.pack.append((t2 - t1) + (t4 - t3))
    timeline.comm.append(t3 - t2)
    timeline.step_seconds.append(t5 - t0)
    timeline.losses.append(float(loss))
    timeline.steps_done = step
    return stop


def train(setup: RankSetup, args: argparse.Namespace, hierarchy: Hierarchy | None) -> Timeline:
    """The steps, with evaluations at step 0, every ``--eval-every`` steps and at the end."""
    dist.barrier()
    timeline = Timeline()
    evaluate_now(setup, args.rank, timeline, 0)
    setup.model.train()
    for step in range(1, setup.steps + 1):
        if train_step(setup, args, hierarchy, timeline, step):
            timeline.stopped_by_time = step < setup.steps
            break
        if args.eval_every and step % args.eval_every == 0 and step < setup.steps:
            evaluate_now(setup, args.rank, timeline, step)
    evaluate_now(setup, args.rank, timeline, timeline.steps_done)
    return timeline


def rank_summary(
    args: argparse.Namespace, model: torch.nn.Module, timeline: Timeline, training_seconds: float
) -> dict[str, Any]:
    """What each rank tells rank 0 at the end (its final digest and times)."""
    return {
        "rank": args.rank,
        "interface": args.interface,
        "final_digest": parameter_digest(model),
        "median_compute_seconds": statistics.median(timeline.compute),
        "median_comm_seconds": statistics.median(timeline.comm),
        "compute_seconds": sum(timeline.compute),
        "comm_seconds": sum(timeline.comm),
        "pack_seconds": sum(timeline.pack),
        "training_seconds": training_seconds,
    }


def run_settings(args: argparse.Namespace, setup: RankSetup, hierarchy: Hierarchy | None) -> dict[str, Any]:
    """The run's settings as rank 0's JSON records them."""
    recipe, world = setup.recipe, args.world_size
    return {
        "world_size": world,
        "steps": setup.steps,
        "eval_every": args.eval_every,
        "bucket_mb": args.bucket_mb,
        "buckets": [buffer.numel() for buffer in setup.reducer.buffers],
        "wire_dtype": args.dtype,
        "groups": args.groups,
        "all_reduce": "hierarchical" if hierarchy else "ring",
        "threads": args.threads,
        "max_seconds": args.max_seconds,
        "master": args.master,
        "interface": args.interface,
        "batch_per_rank": recipe.training.batch_size,
        "global_batch": world * recipe.training.batch_size,
        "sequence_length": recipe.data.sequence_length,
        "tokens_per_step": setup.tokens_per_step,
        "evaluation_batches": recipe.sync.evaluation_batches,
        "recipe": recipe.model_dump(mode="json"),
        "torch": torch.__version__,
    }


def run_result(
    args: argparse.Namespace,
    setup: RankSetup,
    hierarchy: Hierarchy | None,
    timeline: Timeline,
    initial: str,
    everyone: list[dict[str, Any]],
    training_seconds: float,
    wall_seconds: float,
) -> dict[str, Any]:
    """Rank 0's JSON: the settings, bytes per step, per-step timings and losses, totals,
    evaluations and every rank's summary."""
    reducer, done = setup.reducer, timeline.steps_done
    bytes_per_step = reducer.bytes_per_step()
    series = {"compute_seconds": timeline.compute, "pack_seconds": timeline.pack, "comm_seconds": timeline.comm}
    series["step_seconds"] = timeline.step_seconds
    return {
        "settings": run_settings(args, setup, hierarchy),
        "parameters": sum(p.numel() for p in setup.model.parameters() if p.requires_grad),
        "buffer_elements": reducer.elements,
        "bytes_per_step_per_rank": bytes_per_step,
        "leader_ring_bytes_per_step": leader_ring_bytes_per_step(reducer.buffers, args.groups),
        "steps_done": done,
        "stopped_by_time": timeline.stopped_by_time,
        "tokens": done * setup.tokens_per_step,
        "per_step": {**series, "loss": timeline.losses},
        "medians": {name: statistics.median(values) for name, values in series.items()},
        "totals": {
            "compute_seconds": sum(timeline.compute),
            "pack_seconds": sum(timeline.pack),
            "comm_seconds": sum(timeline.comm),
            "training_seconds": training_seconds,
            "wall_seconds": wall_seconds,
            "evaluation_seconds": wall_seconds - training_seconds,
            "bytes_sent_per_rank": done * bytes_per_step,
        },
        "evaluations": timeline.evaluations,
        "initial_digest": initial,
        "ranks": everyone,
        "final_digests_equal": len({r["final_digest"] for r in everyone}) == 1,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.interface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.interface
    setup = set_up(args)
    initial, hierarchy = join_group(args, setup.model)
    timeline = train(setup, args, hierarchy)
    training_seconds = timeline.training_seconds()
    wall_seconds = time.perf_counter() - timeline.started
    everyone: list[dict] = [{}] * args.world_size
    dist.all_gather_object(everyone, rank_summary(args, setup.model, timeline, training_seconds))
    dist.destroy_process_group()
    if args.rank != 0:
        return None
    result = run_result(args, setup, hierarchy, timeline, initial, everyone, training_seconds, wall_seconds)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
