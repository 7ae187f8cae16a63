"""The settings sweep of ``bench.wan --sweep``: whole runs with ``diloco up`` on this
machine (file:// buckets: bytes do not depend on the link) at several settings, their WAN
bytes against data-parallel's at its own final loss (``bench.wan_equal_loss``: each
baseline's bytes per step times the steps data-parallel needs to reach it, over the
setting's whole run), whether and at how many tokens each setting reached that loss, and
the ratios at equal tokens beside them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path

from bench._common import machine
from bench.wan_diloco import learner_figures, tail
from bench.wan_equal_loss import TARGET_SOURCE, diloco_tokens_to_target, dp_steps_to_target, ratio, target_loss
from bench.wan_plan import plan_prediction

TARGET_FLAT_RING = 300.0
TARGET_HIERARCHICAL = 200.0
"""Fewer WAN bytes than each data-parallel baseline to data-parallel's final held-out loss,
which the setting must reach (issue: the codec and schedule that reach 300x)."""
QUIET = ["sync.status_seconds=10", "sync.poll_seconds=2", "training.heartbeat_seconds=10"]
QUIETER = ["sync.status_seconds=30", "sync.poll_seconds=2", "training.heartbeat_seconds=30"]
"""The syncer's status and the heartbeats every 30 s: what they cost is a sixth of the WAN
bytes once payloads are 2 bits (the syncer writes its status to every region and reads
every heartbeat); learners are still declared gone after 60 s of silence."""
BLOCKS_256 = ["sync.learner_codec.block_size=256", "sync.update_codec.block_size=256"]
"""A scale per 256 values instead of 64: 2 bytes of scale are an eighth of an int2 block of 64."""
INT4_UPDATES = "sync.update_codec.codec=int4"
INT2_UPLOADS = "sync.learner_codec.codec=int2"
"""Learners' deltas and reducers' aggregates in 2 bits, with their error feedback."""
INT2_UPDATES = "sync.update_codec.codec=int2"
INT2_BOTH = [INT2_UPLOADS, INT2_UPDATES]
TOPK_UPLOADS = ["sync.learner_codec.codec=topk", "sync.learner_codec.block_size=256"]
"""Learners' deltas and reducers' aggregates as top-k with error feedback (SparseLoCo),
``keep_per_block`` of 256 values: 8 is 3%, 4 is 1.6%."""
SCHEDULE = "sync.sync_interval_schedule=[[50,25],[150,50]]"
"""H=25 for the first 50 steps, 50 until step 150, then the setting's H."""
OUTER_TUNING = (
    (100, ", outer momentum 0.5", ["sync.outer_momentum=0.5"]),
    (100, ", outer lr 0.7, momentum 0.9", ["sync.outer_learning_rate=0.7", "sync.outer_momentum=0.9"]),
    (50, "", []),
    (50, ", outer momentum 0.5", ["sync.outer_momentum=0.5"]),
    (200, "", []),
    (200, ", outer momentum 0.5", ["sync.outer_momentum=0.5"]),
    (200, ", outer lr 1.4", ["sync.outer_learning_rate=1.4"]),
)
"""The outer step tuned for H in {50, 100, 200} with the WAN recipe's codecs: the outer
learning rate (``auto``: 1.0 with K = M) and Nesterov momentum (default 0; DiLoCo's 0.7
and 0.9 at large scale)."""
SWEEP = (
    ("default (H=25, int4/int8)", []),
    ("int4 updates", [INT4_UPDATES]),
    ("H=50, int4 updates", [*QUIET, "sync.sync_interval=50", INT4_UPDATES]),
    ("H=100, int4 updates", [*QUIET, "sync.sync_interval=100", INT4_UPDATES]),
    (
        "H=100, int4 updates, outer lr 1.4",
        [*QUIET, "sync.sync_interval=100", INT4_UPDATES, "sync.outer_learning_rate=1.4"],
    ),
    (
        "H=100, int4 updates, outer momentum 0.5",
        [*QUIET, "sync.sync_interval=100", INT4_UPDATES, "sync.outer_momentum=0.5"],
    ),
    ("H=100, int2 uploads, int4 updates", [*QUIET, "sync.sync_interval=100", INT2_UPLOADS, INT4_UPDATES]),
    ("H=100, int2 uploads and updates", [*QUIET, "sync.sync_interval=100", INT2_UPLOADS, INT2_UPDATES]),
    (
        "H=100, int2 both, reports every 30 s",
        [*QUIETER, "sync.sync_interval=100", INT2_UPLOADS, INT2_UPDATES],
    ),
    (
        "H=100, int2 both in blocks of 256, reports every 30 s",
        [*QUIETER, "sync.sync_interval=100", INT2_UPLOADS, INT2_UPDATES, *BLOCKS_256],
    ),
    (
        "H=100, topk 8 of 256 uploads, int2 updates, reports every 30 s",
        [*QUIETER, "sync.sync_interval=100", *TOPK_UPLOADS, "sync.learner_codec.keep_per_block=8", INT2_UPDATES],
    ),
    (
        "H=100, topk 4 of 256 uploads, int2 updates, reports every 30 s",
        [*QUIETER, "sync.sync_interval=100", *TOPK_UPLOADS, "sync.learner_codec.keep_per_block=4", INT2_UPDATES],
    ),
    (
        "H=50, topk 8 of 256 uploads, int2 updates, reports every 30 s",
        [*QUIETER, "sync.sync_interval=50", *TOPK_UPLOADS, "sync.learner_codec.keep_per_block=8", INT2_UPDATES],
    ),
    ("H=25, 50, then 100, int2 both, reports every 30 s", [*QUIETER, "sync.sync_interval=100", SCHEDULE, *INT2_BOTH]),
    ("H=25, 50, then 200, int2 both, reports every 30 s", [*QUIETER, "sync.sync_interval=200", SCHEDULE, *INT2_BOTH]),
    *(
        (f"H={h}, int2 both, reports every 30 s{label}", [*QUIETER, f"sync.sync_interval={h}", *INT2_BOTH, *outer])
        for h, label, outer in OUTER_TUNING
    ),
)
LABELS = tuple(label for label, _ in SWEEP)


def sweep_run(label: str, overrides: list[str], workdir: Path, timeout: float, attempt: int = 0) -> dict:
    """One whole run with ``diloco up`` on this machine (file:// buckets, default regions);
    raises RuntimeError (with the end of its logs) unless every learner trained its budget."""
    from diloco_cli.bandwidth.prices import load_prices
    from diloco_cli.launch.operations import stop_run
    from diloco_cli.launch.runs import load_run
    from diloco_cli.launch.up import launch
    from diloco_cli.views.report import collect_report, render_json
    from diloco_cli.views.run_state import collect_status, read_buckets

    slug = "-".join(filter(None, "".join(c if c.isalnum() else "-" for c in label.lower()).split("-")))
    digest = hashlib.blake2b(label.encode(), digest_size=3).hexdigest()  # labels alike in their first words
    name = f"sweep-{slug[:32].strip('-')}-{digest}" + (f"-{attempt}" if attempt else "")
    runs_dir = workdir / "sweep-runs"
    started, launched = time.monotonic(), time.time()
    result = launch(None, None, overrides, name, runs_dir, dry_run=False)
    record = load_run(runs_dir, name)
    try:
        while True:
            status = collect_status(result.spec, record.secret())
            if status.state in ("finished", "stopped"):
                break
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"sweep run {label} did not finish in {timeout:.0f} s")
            time.sleep(5)
    finally:  # every process down, finished or not, before the next run or the working directory goes
        stop_run(load_run(runs_dir, name))
    report = json.loads(render_json(collect_report(result.spec, record.secret(), load_prices())))
    evaluations = status.evaluations
    recipe = result.spec.recipe
    budget = (
        recipe.training.num_learners
        * recipe.training.inner_steps
        * recipe.training.batch_size
        * recipe.data.sequence_length
    )
    if status.state != "finished" or report["tokens"] != budget or not evaluations or status.version == 0:
        logs = "\n".join(
            f"--- {log.name}:\n{tail(log, 1200)}" for log in sorted((record.directory / "logs").glob("*.log"))
        )
        raise RuntimeError(
            f"sweep run {name} ({label}) ended {status.state} with {report['tokens']} of {budget} tokens, "
            f"version {status.version}, {len(evaluations)} evaluations\n{logs}"
        )
    seconds = time.monotonic() - started
    learners = learner_figures(read_buckets(result.spec, record.secret(), time.time()).heartbeats, launched)
    return {
        "setting": label,
        "overrides": overrides,
        "commit": machine()["git_commit"],  # a sweep's rows may come from several runs (--settings)
        "seconds": seconds,
        "learners": learners,
        "plan_vs_measured": plan_beside(overrides, learners, report["wan_bytes"]),
        "versions": status.version,
        "tokens": report["tokens"],
        "wan_bytes": report["wan_bytes"],
        "wan_bytes_per_token": report["wan_bytes_per_token"],
        "final_loss": evaluations[-1]["loss"] if evaluations else None,
        "launched": launched,
        "evaluations": evaluations,
        "kinds": report["kinds"],
    }


LOCAL_LINK_MBIT = 10_000.0
"""The plan's link rate for the sweep's file:// buckets: no link limits them."""


def plan_beside(overrides: list[str], learners: dict, wan_bytes: int) -> dict | None:
    """``diloco plan`` for a sweep run's setting, given the step time and start-up its
    learners had, beside what the run measured: its WAN bytes (the whole run's) and the
    learners' compute share of all wall time from the launch."""
    step, startup = learners["median_learner_step_seconds"], learners["startup_seconds"]
    if not step:
        return None
    plan = plan_prediction(None, overrides, step, LOCAL_LINK_MBIT, 0.0, startup_seconds=startup)
    if plan["prediction"] is None:
        return {"error": plan["error"]}
    predicted = plan["prediction"]["diloco"]
    share = learners["compute_share_from_launch"]
    return {
        "wan_bytes": {
            "predicted": predicted["run_wan_bytes"],
            "measured": wan_bytes,
            "percent": 100 * (predicted["run_wan_bytes"] / wan_bytes - 1),
        },
        "compute_share": {
            "predicted": predicted["compute_share_with_startup"],
            "measured": share,
            "points": 100 * (predicted["compute_share_with_startup"] - share),
        },
    }


def replanned(rows: list[dict], reference: dict) -> dict:
    """The rows with ``diloco plan`` run again at this commit for each that recorded its
    learners (the runs are not repeated: a change to the plan is checked against them)."""
    commit = machine()["git_commit"]
    for row in rows:
        if row.get("learners") and row.get("wan_bytes"):
            row["plan_vs_measured"] = plan_beside(row["overrides"], row["learners"], row["wan_bytes"])
            row["plan_commit"] = commit
    return summarize_sweep(rows, reference)


def sweep(
    workdir: Path, reference: dict, timeout: float, write, only: Sequence[str] = (), earlier: Sequence[dict] = ()
) -> dict:
    """Every setting of SWEEP (a run that fails is tried once more, then reported as
    failed), against ``reference``: data-parallel's loss curve and each baseline's WAN
    bytes per step (:func:`dp_reference`).  With ``only``, just those settings run and
    the others keep their rows from ``earlier`` (an earlier sweep's)."""
    kept = {row["setting"]: row for row in earlier}
    rows: list[dict] = []
    for label, overrides in SWEEP:
        if only and label not in only:
            if label in kept:
                rows.append(kept[label])
            continue
        errors = []
        for attempt in range(2):
            try:
                row = sweep_run(label, overrides, workdir, timeout, attempt)
                break
            except RuntimeError as error:
                print(f"  sweep {label}: failed ({str(error)[:3000]})", flush=True)
                errors.append(str(error)[:4000])
        else:
            row = {"setting": label, "overrides": overrides, "final_loss": None, "wan_bytes": None}
        row["errors"] = errors
        rows.append(row)
        print(f"  sweep {label}: loss {row['final_loss']}, {row['wan_bytes']} WAN bytes", flush=True)
        write(summarize_sweep(rows, reference))
    return summarize_sweep(rows, reference)


def dp_reference(dp: dict) -> dict:
    """What the sweep compares with, from ``bench.wan``'s data-parallel results."""
    return {
        "evaluations": dp["loopback"]["evaluations"],
        "final_loss": dp["final_loss"],
        "tokens_per_step": dp["loopback"]["tokens_per_step"],
        "wan_bytes_per_step": {name: b["wan_bytes_per_step"] for name, b in dp["baselines"].items()},
    }


def at_equal_loss(row: dict, reference: dict) -> dict:
    """The row against data-parallel's final loss: whether and when (tokens, seconds from
    its launch, interpolated; rows from before evaluations were kept say only whether,
    from their final loss) it reached it, and each baseline's WAN bytes to it over the
    row's whole run."""
    target = target_loss(reference["evaluations"])
    steps = dp_steps_to_target(reference["evaluations"], target)
    evaluations = row.get("evaluations")
    tokens = diloco_tokens_to_target(evaluations, target) if evaluations else None
    hit = next((e for e in evaluations or () if e["loss"] <= target), None)
    ratios = {
        "target_source": TARGET_SOURCE,
        "target_loss": target,
        "dp_steps_to_target": steps,
        "reached": hit is not None if evaluations else row["final_loss"] <= target,
        "tokens_to_target": tokens,
        "token_overhead": ratio(tokens, steps * reference["tokens_per_step"] if steps is not None else None),
        "seconds_to_target": hit["time"] - row["launched"] if hit and "launched" in row else None,
    }
    for name, per_step in reference["wan_bytes_per_step"].items():
        ratios[f"{name}_over_diloco"] = per_step * steps / row["wan_bytes"] if steps is not None else None
        ratios[f"{name}_over_diloco_equal_tokens"] = (
            per_step / reference["tokens_per_step"] * row["tokens"] / row["wan_bytes"]
        )
    return ratios


PLAN_BYTES_PERCENT = 10.0
PLAN_SHARE_POINTS = 10.0
"""``diloco plan`` within 10% of a run's WAN bytes and 10 points of its compute share, in
every setting of the sweep (the issue's target)."""


def plan_accuracy(rows: list[dict]) -> dict:
    """How far the plan was from each planned row, at worst, and whether every planned row
    is within the targets (rows from before the plan was compared count as unplanned)."""
    planned = [row for row in rows if (row.get("plan_vs_measured") or {}).get("wan_bytes")]
    if not planned:
        return {"planned": 0, "unplanned": len(rows), "within_target": None}
    worst_bytes = max(planned, key=lambda row: abs(row["plan_vs_measured"]["wan_bytes"]["percent"]))
    worst_share = max(planned, key=lambda row: abs(row["plan_vs_measured"]["compute_share"]["points"]))
    bytes_percent = worst_bytes["plan_vs_measured"]["wan_bytes"]["percent"]
    share_points = worst_share["plan_vs_measured"]["compute_share"]["points"]
    return {
        "planned": len(planned),
        "unplanned": len(rows) - len(planned),
        "worst_wan_bytes_percent": bytes_percent,
        "worst_wan_bytes_setting": worst_bytes["setting"],
        "worst_compute_share_points": share_points,
        "worst_compute_share_setting": worst_share["setting"],
        "within_target": abs(bytes_percent) <= PLAN_BYTES_PERCENT and abs(share_points) <= PLAN_SHARE_POINTS,
    }


def summarize_sweep(rows: list[dict], reference: dict) -> dict:
    default = rows[0]
    for row in rows:
        measured = row["final_loss"] is not None and bool(row["wan_bytes"])
        row["loss_vs_default"] = (
            row["final_loss"] / default["final_loss"] - 1 if measured and default["final_loss"] is not None else None
        )
        row["equal_loss"] = at_equal_loss(row, reference) if measured else None
        flat = row["equal_loss"] and row["equal_loss"]["flat_ring_over_diloco"]
        hierarchical = row["equal_loss"] and row["equal_loss"]["hierarchical_over_diloco"]
        row["meets_target"] = bool(
            flat
            and hierarchical
            and row["equal_loss"]["reached"]
            and flat >= TARGET_FLAT_RING
            and hierarchical >= TARGET_HIERARCHICAL
        )
    meeting = [row["setting"] for row in rows if row["meets_target"]]
    ok = [row for row in rows if row["equal_loss"] and row["equal_loss"]["flat_ring_over_diloco"]]
    if not ok:
        verdict = "no setting was measured"
    elif meeting:
        verdict = f"{meeting[0]} reaches data-parallel's final loss and the targets"
    else:  # the best of those that reached the loss; of all, where none did
        best = max(
            [row for row in ok if row["equal_loss"]["reached"]] or ok,
            key=lambda row: row["equal_loss"]["flat_ring_over_diloco"],
        )
        equal = best["equal_loss"]
        verdict = (
            f"missed: the most to data-parallel's final loss is {equal['flat_ring_over_diloco']:.0f}x fewer WAN bytes "
            f"than the flat ring and {equal['hierarchical_over_diloco']:.0f}x than the hierarchical all-reduce "
            f"({best['setting']}, final loss {best['final_loss']:.3f}, {best['loss_vs_default']:+.2%} against the "
            f"default, {'reached' if equal['reached'] else 'never reached'} data-parallel's "
            f"{equal['target_loss']:.3f})"
        )
    return {
        "plan": plan_accuracy(rows),
        "reference": {key: value for key, value in reference.items() if key != "evaluations"},
        "target": f"reach {TARGET_SOURCE}, with >= {TARGET_FLAT_RING:.0f}x fewer WAN bytes than the flat ring "
        f"and >= {TARGET_HIERARCHICAL:.0f}x than the hierarchical all-reduce, each counted to that loss",
        "rows": rows,
        "meeting": meeting,
        "verdict": verdict,
    }
