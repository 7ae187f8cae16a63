"""The settings sweep of ``bench.wan --sweep``: whole runs with ``diloco up`` on this
machine (file:// buckets: bytes do not depend on the link) at several settings, their WAN
bytes per token against held-out loss at equal tokens, beside data-parallel's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.wan_diloco import tail

SWEEP_BYTES_RATIO = 500.0
SWEEP_LOSS_TOLERANCE = 0.02
QUIET = ["sync.status_seconds=10", "sync.poll_seconds=2", "training.heartbeat_seconds=10"]
SWEEP = (
    ("default (H=25, int4/int8)", []),
    ("H=50", [*QUIET, "sync.sync_interval=50"]),
    ("H=100", [*QUIET, "sync.sync_interval=100"]),
    ("H=100, int4 updates", [*QUIET, "sync.sync_interval=100", "sync.update_codec.codec=int4"]),
    (
        "H=100, int4 updates, snapshot_every=1000",
        [*QUIET, "sync.sync_interval=100", "sync.update_codec.codec=int4", "sync.snapshot_every=1000"],
    ),
)


def sweep_run(label: str, overrides: list[str], workdir: Path, timeout: float, attempt: int = 0) -> dict:
    """One whole run with ``diloco up`` on this machine (file:// buckets, default regions);
    raises RuntimeError (with the end of its logs) unless every learner trained its budget."""
    from diloco_cli.bandwidth.prices import load_prices
    from diloco_cli.launch.operations import stop_run
    from diloco_cli.launch.runs import load_run
    from diloco_cli.launch.up import launch
    from diloco_cli.views.report import collect_report, render_json
    from diloco_cli.views.run_state import collect_status

    name = "sweep-" + "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-")[:40].strip("-")
    name = "-".join(filter(None, name.split("-"))) + (f"-{attempt}" if attempt else "")
    runs_dir = workdir / "sweep-runs"
    started = time.monotonic()
    result = launch(None, None, overrides, name, runs_dir, dry_run=False)
    record = load_run(runs_dir, name)
    done = False
    try:
        while True:
            status = collect_status(result.spec, record.secret())
            if status.state in ("finished", "stopped"):
                done = True
                break
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"sweep run {label} did not finish in {timeout:.0f} s")
            time.sleep(5)
    finally:
        if not done:
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
    return {
        "setting": label,
        "overrides": overrides,
        "seconds": time.monotonic() - started,
        "versions": status.version,
        "tokens": report["tokens"],
        "wan_bytes": report["wan_bytes"],
        "wan_bytes_per_token": report["wan_bytes_per_token"],
        "final_loss": evaluations[-1]["loss"] if evaluations else None,
        "kinds": report["kinds"],
    }


def sweep(workdir: Path, dp_bytes_per_token: float, timeout: float, write) -> dict:
    """Every setting of SWEEP (a run that fails is tried once more, then reported as failed)."""
    rows: list[dict] = []
    for label, overrides in SWEEP:
        errors = []
        for attempt in range(2):
            try:
                row = sweep_run(label, overrides, workdir, timeout, attempt)
                break
            except RuntimeError as error:
                print(f"  sweep {label}: failed ({str(error)[:3000]})", flush=True)
                errors.append(str(error)[:4000])
        else:
            row = {"setting": label, "overrides": overrides, "final_loss": None, "wan_bytes_per_token": None}
        row["errors"] = errors
        rows.append(row)
        print(f"  sweep {label}: loss {row['final_loss']}, {row['wan_bytes_per_token']} WAN B/token", flush=True)
        write(summarize_sweep(rows, dp_bytes_per_token))
    return summarize_sweep(rows, dp_bytes_per_token)


def summarize_sweep(rows: list[dict], dp_bytes_per_token: float) -> dict:
    default = rows[0]
    for row in rows:
        measured = row["final_loss"] is not None and default["final_loss"] is not None
        row["loss_vs_default"] = row["final_loss"] / default["final_loss"] - 1 if measured else None
        row["dp_bytes_ratio"] = dp_bytes_per_token / row["wan_bytes_per_token"] if row["wan_bytes_per_token"] else None
        row["meets_target"] = bool(
            measured
            and row["dp_bytes_ratio"]
            and row["dp_bytes_ratio"] >= SWEEP_BYTES_RATIO
            and row["loss_vs_default"] <= SWEEP_LOSS_TOLERANCE
        )
    meeting = [row["setting"] for row in rows if row["meets_target"]]
    ok = [row for row in rows if row["dp_bytes_ratio"] is not None and row["loss_vs_default"] is not None]
    if not ok:
        return {
            "dp_wan_bytes_per_token": dp_bytes_per_token,
            "rows": rows,
            "meeting": [],
            "verdict": "no setting was measured",
        }
    best = max(ok, key=lambda row: row["dp_bytes_ratio"])
    verdict = (
        f"{meeting[0]} reaches {SWEEP_BYTES_RATIO:.0f}x within {SWEEP_LOSS_TOLERANCE:.0%} loss"
        if meeting
        else f"missed: the most is {best['dp_bytes_ratio']:.0f}x fewer WAN bytes per token ({best['setting']}, "
        f"{best['wan_bytes_per_token']:.3f} B/token against data-parallel's {dp_bytes_per_token:.1f}) at "
        f"{best['loss_vs_default']:+.2%} loss against the default"
    )
    return {
        "dp_wan_bytes_per_token": dp_bytes_per_token,
        "target": f">= {SWEEP_BYTES_RATIO:.0f}x fewer WAN bytes per token "
        f"than data-parallel within {SWEEP_LOSS_TOLERANCE:.0%} of the default's held-out loss",
        "rows": rows,
        "meeting": meeting,
        "verdict": verdict,
    }
