"""Benchmark: the tool against real synchronous data-parallel over an emulated WAN.

The scenario: the default recipe (byte-level GPT, 0.84M parameters, batch 16, 300 inner
steps, H=25, P=2, int4 uploads, int8 updates), two regions (``east``, ``west``) of two
learners each and the syncer in a third place (``syncer``), all on ``testbed.wan.emulated_wan``:
one network namespace per place, every place's link to a router shaped with tbf at R Mbit/s
(the syncer's at R x regions: it carries both regions), a moto S3 per region, and in front of
it a proxy that adds L ms each way (40 by default) for every other place and counts bytes.
A region's endpoint is ``http://s3-<region>:9001`` in the run's spec; each place's own hosts
file resolves it: inside the region to a zero-delay counting proxy on loopback, elsewhere to
the delaying proxy on the region's WAN address.

1. Synchronous data-parallel on loopback (``bench.ddp_worker``, W = M gloo ranks, the same
   global batch M x 16 and token budget, bf16 ring all-reduce), every step of the budget,
   evaluated every ``--dp-eval-every`` steps: the loss against steps, the compute time per
   step c and the bytes per step per rank B.
2. The link rate: R = B x 8 / (ratio x c) Mbit/s, so that a data-parallel step on the WAN
   communicates ``--comm-ratio`` (30) times longer than it computes (the source's 12B model on
   2-5 Gbit/s, scaled down).  The measured ratio is reported beside it.
3. Synchronous data-parallel on the WAN: the same ranks, M/2 in each region's namespace
   (gloo bound to its WAN device, rank 0 in east as the master), for ``--dp-wan-seconds``
   (a few steps: the full budget would take hours): median seconds per step, split into
   compute and communication, and the bytes that crossed the links.
   Twice: a flat ring all-reduce (R of its W hops cross), and a hierarchical one (each
   region reduces onto a leader, the leaders' ring all-reduces, each leader broadcasts:
   ``bench.ddp_worker --groups``), the strongest synchronous baseline on a WAN.
   Data-parallel's time to the target = (steps to reach the target in 1) x (median WAN step
   seconds of 3).  The kernel has no netem: gloo's traffic gets the links' rate but not
   their latency, so this is optimistic for data-parallel by about 2 (W-1) x L per step
   (reported beside it).
4. Decoupled DiLoCo on the WAN: the real learners, reducers and syncer (``python -m
   diloco_cli _learner/_syncer/_reducer`` started in their namespaces), the whole budget;
   where its evaluations never reach the target (5), again on ``--longer`` (2) times the
   budget's inner steps, stopped at the first syncer evaluation at or below it (or at its
   end).  Time to the target is that evaluation's, from the moment the processes were
   started; compute share = sum of the learners' compute_seconds / sum of (time -
   started_at) in their final heartbeats; bytes per link from the run's report (``diloco
   report``'s JSON, built in-process), from the proxies' counters and from the WAN devices'.
   With ``--reference RESULT`` (a ``bench.quality`` result of the same model, tokens, global
   batch and learning rate, e.g. at 20 tokens per parameter), data-parallel's curve is the
   mean of that result's tuned data-parallel seeds instead (the floor its floor row), and
   data-parallel on loopback runs ``--calibration-steps`` only, for c and B.
5. The target loss: data-parallel's final held-out evaluation at the budget (1, this run):
   is DiLoCo's model as good as data-parallel's, and what does it cost to get there?  At
   the target (``equal_loss`` in the JSON, ``bench.wan_equal_loss``): DiLoCo's learner
   tokens to it (linear between the syncer's evaluations that straddle it) and its token
   overhead over data-parallel's (the budget, or fewer where data-parallel's curve dips
   below its final loss before its end), its time from the launch and its WAN bytes (those
   of a run stopped at the target, else the whole run's: ``rule`` says which); each
   data-parallel baseline's WAN bytes and seconds per step x its steps to the target.  The
   floor: one learner alone on 1/M of the tokens at the learners' batch, learning rate and
   schedule (in this process, ``bench.quality_runs.train_in_process``); a DiLoCo run whose
   final loss is not below the floor's is FAILING (``diloco_beats_floor: false``), whatever
   its ratios.
6. ``diloco plan``'s prediction for the same recipe, regions, step time c, R and L, beside
   the measurement (compute share in points, WAN bytes in %; DiLoCo's figures from the
   plan given the step its learners took in the run, slower than c on shared cores, and
   their measured start-up); its link rate for 90%
   computing beside data-parallel's measured one (``bench.wan_link_rate``), and with
   ``--check-link-rate`` (full mode only) DiLoCo run again at the plan's rate and at half
   of it.
7. ``--sweep`` (full mode only): WAN bytes at several settings (``bench.wan_sweep.SWEEP``:
   int4 published updates, H=50, 100 and 200 with the outer learning rate and momentum
   tuned for each, int2 uploads with int4 or int2 updates, top-k uploads (8 and 4 of
   256), H schedules (25, 50, then 100 or 200); all but the default's H with less
   chatter), each a whole run with ``diloco up`` on this
   machine (file:// buckets: bytes do not depend on the link), against both data-parallel
   baselines counted to the steps data-parallel needs to reach its own final loss (5), and
   whether and at how many tokens each setting reached that loss: which reaches it with
   >= 300x fewer than the flat ring and >= 200x fewer than the hierarchical all-reduce;
   and ``diloco plan`` for each setting, given the step and start-up its learners had,
   against its WAN bytes and compute share.

    python -m bench.wan                  # the full race (~10 min on 2 cores, more with the longer run; root, iproute2)
    python -m bench.wan --sweep          # and the settings sweep (~25 min more)
    python -m bench.wan --sweep-from bench/results/wan.demo-horizon.json   # the sweep alone, against that run
    python -m bench.wan --sweep-from bench/results/wan.demo-horizon.json --settings "H=100, int2 uploads, int4 updates"
    python -m bench.wan --learners 8     # 2 regions x 4 learners (~20 min)
    python -m bench.wan --recipe recipes/wan.yaml --reference bench/results/quality.json
                                         # at 20 tokens per parameter (62 min with the longer run)
    python -m bench.wan --quick          # a tiny model and budget (the test suite, ~1 min)

Results: ``bench/results/wan.json`` (``wan.quick.json``), and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._common import write_result
from bench.ddp_launch import launch_local
from bench.quality_runs import InProcess, train_in_process
from bench.wan_diloco import (
    MEASURE,
    QUICK_RUN,
    REGIONS,
    REPOSITORY,
    SYNCER,
    diloco_on_wan,
)
from bench.wan_dp import calibration, dp_on_wan, dp_result, dp_summary, print_dp_wan
from bench.wan_equal_loss import (
    TARGET_SOURCE,
    diloco_to_target,
    equal_loss,
    first_at_or_below,
    quality_reference,
    target_loss,
)
from bench.wan_link_rate import check_diloco_rate, dp_rate_for_target
from bench.wan_link_rate import summarize as summarize_link_rates
from bench.wan_options import parse_args, recipe_overrides
from bench.wan_plan import plan_prediction, plan_vs_measured
from bench.wan_show import show, show_sweep
from bench.wan_sweep import dp_reference, replanned, sweep
from diloco_cli.config.files import load_recipe
from diloco_cli.config.recipe import Recipe

# Measurement settings, not training ones: one thread per learner (2 cores, 4 learners) and an
# evaluation of the global model at every version (time to the target needs them close).
QUICK = [*QUICK_RUN, "training.num_learners=2", "training.inner_steps=30"]


# ----------------------------------------------------------------------------- helpers


def overrides_for(quick: bool) -> list[str]:
    return [*MEASURE, *(QUICK if quick else [])]


# --------------------------------------------------------------------------- main


def sweep_only(args: argparse.Namespace) -> dict:
    """The sweep alone, against an earlier full run's data-parallel results; the sweep
    replaces the one in that file."""
    document = json.loads(args.sweep_from.read_text())
    if document.get("quick") or "baselines" not in document.get("results", {}).get("dp", {}):
        raise SystemExit(
            f"{args.sweep_from} holds no full run's data-parallel baselines (a quick run, or one from before "
            "the hierarchical baseline): run python -m bench.wan first"
        )
    results = document["results"]
    workdir = Path(tempfile.mkdtemp(prefix="bench-wan-sweep-"))
    timeout = args.timeout or 3600.0

    def write(partial: dict) -> None:
        results["sweep"] = partial
        args.sweep_from.write_text(json.dumps(document, indent=2) + "\n")

    try:
        earlier = results.get("sweep", {}).get("rows", [])
        if args.replan:
            write(replanned(earlier, dp_reference(results["dp"])))
        else:
            write(sweep(workdir, dp_reference(results["dp"]), timeout, write, args.settings, earlier))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    show_sweep(results["sweep"])
    print(f"wrote {args.sweep_from}")
    return results


def race_settings(
    args: argparse.Namespace, recipe: Recipe, overrides: Sequence[str], eval_every: int
) -> dict[str, Any]:
    """The race's settings as its JSON records them."""
    world, steps = recipe.training.num_learners, recipe.training.inner_steps
    sync = recipe.sync
    return {
        "recipe": str(args.recipe or "the default recipe"),
        "reference": str(args.reference) if args.reference else None,
        "recipe_overrides": overrides,
        "diloco_overrides": args.diloco_set,
        "model": recipe.model.model_dump(),
        "learners": world,
        "regions": list(REGIONS),
        "learners_per_region": world // len(REGIONS),
        "syncer_place": args.syncer_in,
        "batch_per_learner": recipe.training.batch_size,
        "sequence_length": recipe.data.sequence_length,
        "inner_steps": steps,
        "sync_interval": sync.sync_interval,
        "fragments": sync.num_fragments,
        "learner_codec": getattr(sync.learner_codec.codec, "value", str(sync.learner_codec.codec)),
        "update_codec": getattr(sync.update_codec.codec, "value", str(sync.update_codec.codec)),
        "tokens": world * steps * recipe.training.batch_size * recipe.data.sequence_length,
        "latency_ms": args.latency_ms,
        "comm_ratio_target": args.comm_ratio,
        "dp_eval_every": eval_every,
        "dp_wire_dtype": "bf16",
        "threads_per_process": 1,
    }


class PhaseClock:
    """How long each phase of the race took, into ``seconds`` (the JSON's ``phase_seconds``)."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds, self.phase, self.since = seconds, None, time.monotonic()

    def __call__(self, name: str | None, line: str = "") -> None:
        """Start phase ``name`` (None: the end), closing the one before it."""
        now = time.monotonic()
        if self.phase:
            self.seconds[self.phase] = round(now - self.since, 2)
        self.phase, self.since = name, now
        if line:
            print(line, flush=True)


def runs_on_wan(
    args: argparse.Namespace,
    wan: Any,
    recipe: Recipe,
    overrides: Sequence[str],
    workdir: Path,
    timeout: float,
    phase: PhaseClock,
    target: float,
) -> dict[str, dict | None]:
    """Data-parallel on the WAN for a few steps (flat ring, then hierarchical), then
    Decoupled DiLoCo for the whole run, and where that never reaches ``target``, again on
    ``--longer`` times the budget's inner steps until it does."""
    world, steps = recipe.training.num_learners, recipe.training.inner_steps
    dp_steps, dp_seconds = (
        (3, None) if args.quick and args.dp_wan_seconds is None else (steps, args.dp_wan_seconds or 60.0)
    )
    what = f"{dp_steps} steps" if dp_seconds is None else f"{dp_seconds:g} s of training"
    phase("dp_wan", f"data-parallel on the WAN: {what}")
    dp_wan = dp_on_wan(wan, world, overrides, dp_steps, dp_seconds, timeout)
    print_dp_wan(dp_wan)
    phase("dp_wan_hierarchical", "data-parallel on the WAN, hierarchical all-reduce (a ring of region leaders)")
    hierarchical_wan = dp_on_wan(wan, world, overrides, dp_steps, dp_seconds, timeout, hierarchical=True)
    print_dp_wan(hierarchical_wan)
    phase("diloco_wan", "Decoupled DiLoCo on the WAN: the whole run")
    diloco = diloco_on_wan(wan, [*overrides, *args.diloco_set], workdir, timeout, args.syncer_in)
    _print_diloco(diloco)
    longer = None
    if first_at_or_below(diloco["evaluations"], target) is None:
        longer_steps = round(args.longer * steps)
        phase(
            "diloco_wan_longer",
            f"Decoupled DiLoCo on the WAN: {diloco['final_loss']:.4f} at the budget, above the target {target:.4f}; "
            f"again on {longer_steps} inner steps ({args.longer:g}x), stopped at the target",
        )
        longer_overrides = [*overrides, *args.diloco_set, f"training.inner_steps={longer_steps}"]
        longer = diloco_on_wan(wan, longer_overrides, workdir, timeout, args.syncer_in, stop_at=target)
        _print_diloco(longer)
    return {"dp_wan": dp_wan, "hierarchical_wan": hierarchical_wan, "diloco": diloco, "diloco_longer": longer}


def _print_diloco(diloco: dict) -> None:
    print(
        f"  {diloco['wall_seconds']:.0f} s{', stopped at the target' if diloco['stopped_at_target'] else ''}, "
        f"final loss {diloco['final_loss']:.4f}, "
        f"compute share {diloco['compute_share']:.1%} of the learners' lives, "
        f"{diloco['compute_share_from_launch']:.1%} from the launch, "
        f"{diloco['wan_bytes_per_token']:.2f} WAN B/token",
        flush=True,
    )


def plans_and_rates(
    args: argparse.Namespace,
    wan: Any,
    overrides: Sequence[str],
    workdir: Path,
    timeout: float,
    calibrated: dict,
    diloco: dict,
    phase: PhaseClock,
) -> dict[str, Any]:
    """The plan's prediction for the scenario, and again at the step the learners took in
    the run; with ``--check-link-rate``, DiLoCo at the plan's link rate for 90% computing."""
    phase("plan", "diloco plan for the same scenario")
    diloco_overrides = [*overrides, *args.diloco_set]
    c, rate = calibrated["dp_compute_seconds_per_step"], calibrated["link_mbit"]
    plan = plan_prediction(workdir / "regions.json", diloco_overrides, c, rate, args.latency_ms)
    # beside the measurement: the plan given the step the learners took in the run (on
    # these shared cores, with the reducers, syncer, proxies and servers, slower than c);
    # the link rates stay those of c, the step the scenario was calibrated with
    run_step = diloco.get("median_learner_step_seconds")
    plan_at_run_step = plan
    if run_step:
        startup = diloco.get("startup_seconds") or diloco["learners_started_after_seconds"]
        plan_at_run_step = plan_prediction(
            workdir / "regions.json", diloco_overrides, run_step, rate, args.latency_ms, startup_seconds=startup
        )
    plan_rates = (plan["prediction"] or {}).get("link_rates") or {}
    rate_runs = []
    if args.check_link_rate and plan_rates.get("diloco_mbit"):
        phase("link_rate", "Decoupled DiLoCo at the plan's link rate for 90% computing, and at half of it")
        rate_runs = check_diloco_rate(
            wan, plan_rates["diloco_mbit"], diloco_overrides, workdir, timeout, args.syncer_in
        )
    return {"plan": plan, "plan_at_run_step": plan_at_run_step, "plan_rates": plan_rates, "rate_runs": rate_runs}


def race_result(
    args: argparse.Namespace, loopback: dict, on_wan: dict, planned: dict, eval_every: int, floor: dict
) -> dict:
    """Both sides at data-parallel's final loss, their ratios, the floor, the plan against
    the measurement and the link rates."""
    diloco, dp_wan, hierarchical_wan = on_wan["diloco"], on_wan["dp_wan"], on_wan["hierarchical_wan"]
    target = target_loss(loopback["evaluations"])
    dp = dp_result(args, loopback, on_wan, target, eval_every)
    runs = {"the budget": diloco, f"{args.longer:g}x the budget": on_wan["diloco_longer"]}
    reached = diloco_to_target(runs, target)
    diloco["time_to_target_seconds"] = reached["time_to_target_seconds"]
    diloco["version_at_target"] = reached["version_at_target"]
    diloco["schedule_at_target"] = reached["schedule"]
    both_hit = dp["steps_to_target"] is not None and reached["reached"]
    rate = planned["rate"]
    return {
        "target": {
            "loss": target,
            "source": TARGET_SOURCE,
            "rule": "data-parallel's final held-out evaluation at the budget, "
            + (f"the mean of its seeds in {args.reference}" if args.reference else "measured in this run"),
            "diloco_final": diloco["final_loss"],
            "dp_final": dp["final_loss"],
            "floor_final": floor["final_loss"],
        },
        "dp": dp,
        "diloco": diloco,
        "diloco_longer": on_wan["diloco_longer"],
        "floor": floor,
        "equal_loss": equal_loss(dp, reached, diloco["final_loss"], floor["final_loss"]),
        "ratios": {
            "time_to_target_dp_over_diloco": dp["time_to_target_seconds"] / diloco["time_to_target_seconds"]
            if both_hit
            else None,
            "wan_bytes_per_token_dp_over_diloco": dp["wan_bytes_per_token"] / diloco["wan_bytes_per_token"],
            "wan_bytes_per_token_wire_dp_over_diloco": dp["wan_bytes_per_token_wire"]
            / diloco["wan_bytes_per_token_wire"],
            "measured_dp_comm_to_compute": dp_wan["comm_to_compute"],
        },
        "plan": planned["plan"],
        "plan_at_run_step": planned["plan_at_run_step"],
        "plan_vs_measured": plan_vs_measured(
            planned["plan_at_run_step"]["prediction"], diloco, dp, planned["plan"]["prediction"]
        ),
        "link_rates": summarize_link_rates(
            planned["plan_rates"],
            {"flat_ring": dp_rate_for_target(dp_wan, rate), "hierarchical": dp_rate_for_target(hierarchical_wan, rate)},
            planned["rate_runs"],
        ),
    }


def race(args: argparse.Namespace, recipe: Recipe, overrides: Sequence[str], workdir: Path, results: dict) -> None:
    """Data-parallel on loopback (the loss against steps, c and B), the WAN calibrated from
    it, both sides on the emulated WAN, the plan, and the comparison at equal loss."""
    from testbed.wan import emulated_wan

    world, steps = recipe.training.num_learners, recipe.training.inner_steps
    eval_every, timeout = race_limits(args)
    phase = PhaseClock(results["phase_seconds"])
    if args.reference:
        reference = quality_reference(json.loads(args.reference.read_text()), str(args.reference), recipe)
        phase(
            "dp_loopback",
            f"data-parallel on loopback: {world} ranks, {args.calibration_steps} steps for c and B "
            f"(its curve and the floor: {args.reference})",
        )
        loopback = dp_summary(
            launch_local(world, args.calibration_steps, overrides=overrides, timeout=timeout, workdir=workdir)
        )
        loopback |= {"evaluations": reference.pop("evaluations"), "reference": reference}
        floor = reference.pop("floor")
    else:
        phase("dp_loopback", f"data-parallel on loopback: {world} ranks, {steps} steps")
        loopback = dp_summary(
            launch_local(world, steps, overrides=overrides, eval_every=eval_every, timeout=timeout, workdir=workdir)
        )
        phase("floor", f"the floor: one learner alone on 1/{world} of the tokens, in this process")
        floor = floor_run(load_recipe(None, [*overrides, *args.diloco_set]))
    calibrated = results["calibration"] = calibration(args, loopback)
    target = target_loss(loopback["evaluations"])
    print(f"  the floor's final loss {floor['final_loss']:.4f}; the target, data-parallel's: {target:.4f}", flush=True)
    rate, syncer_rate = calibrated["link_mbit"], calibrated["syncer_link_mbit"]
    phase("emulation")
    with emulated_wan(
        REGIONS, [SYNCER], rate_mbit=rate, rates={SYNCER: syncer_rate}, latency_ms=args.latency_ms, hostnames=True
    ) as wan:
        results["emulation"] = {
            "namespaces": {label: place.name for label, place in wan.places.items()} | {"router": wan.router.name},
            "hosts_files": {label: str(path) for label, path in wan.hosts_files.items()},
            "wan_addresses": {label: place.wan_address for label, place in wan.places.items()},
        }
        on_wan = runs_on_wan(args, wan, recipe, overrides, workdir, timeout, phase, target)
        planned = plans_and_rates(args, wan, overrides, workdir, timeout, calibrated, on_wan["diloco"], phase)
        phase("teardown")
    results.update(race_result(args, loopback, on_wan, planned | {"rate": rate}, eval_every, floor))
    phase(None)


def floor_run(recipe: Recipe) -> dict[str, Any]:
    """The floor: one learner alone on its share (1/M) of the tokens, at the learners'
    batch, learning rate and schedule (AdamW in this process, one thread, as a learner has:
    ``bench.quality_runs.train_in_process``), evaluated as the syncer evaluates.  What a
    learner reaches without communicating: a DiLoCo run must end below it."""
    import torch

    training = recipe.training
    tokens = training.inner_steps * training.batch_size * recipe.data.sequence_length  # a learner's share
    run = InProcess(training.learning_rate, training.batch_size, tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(training.threads_per_learner or 1)
    try:
        result = train_in_process(recipe, run)
    finally:
        torch.set_num_threads(threads)
    return {
        "learners_share": f"1/{training.num_learners}",
        "how": f"in-process AdamW, {training.inner_steps} steps of batch {run.batch}",
        "learning_rate": run.learning_rate,
        "batch": run.batch,
        "inner_steps": training.inner_steps,
        "tokens": result["tokens"],
        "seconds": result["seconds"],
        "evaluations": result["evaluations"],
        "final_loss": result["evaluations"][-1][1],
    }


def race_limits(args: argparse.Namespace) -> tuple[int, float]:
    """Data-parallel's evaluation interval on loopback and the timeout of any one run."""
    return args.dp_eval_every or (5 if args.quick else 10), args.timeout or (240.0 if args.quick else 3600.0)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(__doc__, argv)
    if args.sweep_from:
        return sweep_only(args)
    if os.geteuid() != 0:
        raise SystemExit("bench.wan needs root (network namespaces, tc)")
    sys.path.insert(0, str(REPOSITORY))
    from testbed.wan import S3_ENV

    os.environ.update(S3_ENV)  # this process prepares and reads the buckets (moto takes any key)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a TERM cleans up as Ctrl-C does
    overrides = [*recipe_overrides(args.recipe), *overrides_for(args.quick)]
    overrides += [f"training.num_learners={args.learners}"] if args.learners else []
    recipe = load_recipe(None, overrides)
    eval_every, timeout = race_limits(args)
    workdir = Path(tempfile.mkdtemp(prefix="bench-wan-"))
    settings = race_settings(args, recipe, overrides, eval_every)
    results: dict[str, Any] = {"phase_seconds": {}}

    def write(partial: dict | None = None) -> Path:
        if partial is not None:
            results["sweep"] = partial
        return write_result("wan", args.quick, settings, results, args.output)

    try:
        race(args, recipe, overrides, workdir, results)
        path = write()
        if args.sweep:
            phase = PhaseClock(results["phase_seconds"])
            phase("sweep", "settings sweep (diloco up on this machine, file:// buckets)")
            results["sweep"] = sweep(workdir, dp_reference(results["dp"]), timeout, write)
            phase(None)
            path = write()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    show(results)
    print(f"wrote {path}")
    return results


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    main()
