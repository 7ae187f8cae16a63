"""Benchmark 3: the global model's held-out loss against synchronous data-parallel.

Same model, same data, equal tokens.  The baseline is synchronous data-parallel with the
global batch M*b (one process with batch M*b is the same mathematics as DDP over M
workers), its learning rate tuned on a grid at an eighth of the budget.  The DiLoCo rows
run the real learners and syncer (``diloco up`` on this machine, file:// buckets):
K=M with fp32 and with int4 outer gradients, and Decoupled K=1 with the grace window in
int4.  Losses are reported at a quarter, half and all of the token budget.  One more row
trains the same model (its embedding sized to the vocabulary) on tokens: a byte-level BPE
tokenizer that ``diloco prepare`` trains on the same corpus, streamed from its shards.
Its loss is in nats per token, so every row also reports bits per byte (nats per token /
ln 2 / bytes per token of the held-out text), the measure that compares the two.  The headline
rows (data-parallel and Decoupled K=1) run ``--seeds`` seeds, the K=M rows
``--other-seeds`` (each full row costs about 15 minutes on 2 cores).

Both sides are tuned the same way: data-parallel's learning rate over a grid, and the
DiLoCo learners' inner learning rate and H over a grid, each at an eighth of the budget
(the schedule of the full run, stopped there).  The rows run the defaults; the best
DiLoCo setting gets rows of its own beside them ("tuned"), unless it is the default.

    python -m bench.quality                 # 10M tokens, 2 seeds for the headline rows
    python -m bench.quality --quick         # a tiny model and budget, 2 learners (the test suite)
    python -m bench.quality --resume        # run only the rows the result file lacks

The learners are in two local regions, each with its reducer (aggregates under K = M,
relays under K < M).  Relays against the syncer reading the payloads itself, measured
before that mode was removed: bench/results/quality-k1-relays.json (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._common import benchmark_parser, local_regions, print_table, result_path, write_result
from diloco_cli.config.recipe import Recipe
from diloco_cli.data.corpora import builtin_corpus
from diloco_cli.data.text import TextSplit, evaluation_batches, load_text, random_batch
from diloco_cli.launch.operations import stop_run
from diloco_cli.launch.runs import load_run
from diloco_cli.launch.up import launch
from diloco_cli.training.inner import InnerSchedule, evaluate, inner_step, make_inner_optimizer
from diloco_cli.views.run_state import collect_status

FRACTIONS = (0.25, 0.5, 1.0)
TARGET_ASYNC_VS_SYNC = 0.02
TARGET_DILOCO_VS_DP = 0.05
DATA_PARALLEL = "data-parallel (batch M*b)"
TUNED_SYNC = "DiLoCo K=M int4 tuned"
TUNED_ASYNC = "Decoupled K=1 grace int4 tuned"
TOKENS_ROW = "DiLoCo K=M int4 on BPE tokens"
"""Merging in the regions (each region's sends summed into one aggregate and re-quantized)
changes the held-out loss by at most this fraction, either way."""
TOKENS_VOCABULARY = 512
"""The BPE vocabulary of the tokens row: at width 128 its embedding adds 33K parameters
to the 0.84M of the byte-level model."""


def prepare_tokens(workdir: Path) -> tuple[str, float]:
    """``diloco prepare`` on the built-in corpus: the dataset's index and the held-out
    text's bytes per token (to turn nats per token into bits per byte)."""
    import numpy as np
    from tokenizers import Tokenizer

    corpus, dataset = workdir / "corpus.txt", workdir / "tokens"
    corpus.write_bytes(builtin_corpus("shakespeare"))
    command = [
        sys.executable,
        "-m",
        "diloco_cli",
        "prepare",
        str(corpus),
        "-o",
        str(dataset),
        "--vocab-size",
        str(TOKENS_VOCABULARY),
        "--heldout-fraction",
        "0.05",
    ]
    subprocess.run(command, check=True, capture_output=True)
    index = json.loads((dataset / "index.json").read_text())
    heldout = np.fromfile(dataset / index["heldout"]["name"], dtype=index["dtype"])
    text = Tokenizer.from_file(str(dataset / index["tokenizer"])).decode(heldout.tolist(), skip_special_tokens=False)
    return str(dataset / "index.json"), len(text.encode("utf-8")) / len(heldout)


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    return nats_per_token / math.log(2) / bytes_per_token


def recipe_for(args: argparse.Namespace, seed: int, overrides: dict) -> Recipe:
    base = {
        "name": "quality",
        "training": {"seed": seed, "inner_steps": args.steps_per_learner, "heartbeat_seconds": 1.0},
        "sync": {"evaluate_every": args.evaluate_every},
    }
    if args.quick:
        base["model"] = {"kwargs": {"num_layers": 2, "width": 64, "num_heads": 2, "context": 64}}
        base["data"] = {"sequence_length": 64}
        base["training"].update(
            {"num_learners": 2, "batch_size": 8, "warmup_steps": 5, "poll_seconds": 0.3, "heartbeat_seconds": 0.5}
        )
        base["sync"].update({"sync_interval": 10, "evaluation_batches": 2})
    merged = json.loads(json.dumps(base))
    for section, values in overrides.items():
        merged.setdefault(section, {}).update(values)
    return Recipe.model_validate(merged)


def tokens_per_learner_step(recipe: Recipe) -> int:
    return recipe.training.batch_size * recipe.data.sequence_length


def loss_at(evaluations: list[dict], tokens: float) -> float:
    """The evaluation nearest to ``tokens`` processed (learner tokens, summed)."""
    return min(evaluations, key=lambda e: abs(e["tokens"] - tokens))["loss"]


def run_diloco(recipe: Recipe, name: str, workdir: Path, stop_at: float | None = None) -> dict:
    """Train through the real CLI path (processes, buckets) and read the syncer's
    evaluations; with ``stop_at`` (a fraction of the budget) the run is stopped once the
    global model was evaluated past that many tokens."""
    recipe_path = workdir / f"{name}.json"
    recipe_path.write_text(recipe.model_dump_json())
    started = time.monotonic()
    regions = local_regions(workdir, recipe.training.num_learners)
    result = launch(recipe_path, regions, [], name, workdir / "runs", dry_run=False)
    budget = recipe.training.num_learners * recipe.training.inner_steps * tokens_per_learner_step(recipe)
    while True:
        status = collect_status(result.spec)
        if status.state in ("finished", "stopped"):
            break
        if stop_at is not None and any(e["tokens"] >= stop_at * budget for e in status.evaluations):
            break
        time.sleep(2 if stop_at else 5)
    # every process down before the caller removes the buckets: a reducer still finishing
    # when its bucket vanished was left retrying, supervised, after the benchmark ended
    stop_run(load_run(workdir / "runs", name))
    evaluations = status.evaluations
    if stop_at is not None:  # the first evaluation past the stop (the run may have ended sooner)
        past = [e for e in evaluations if e["tokens"] >= stop_at * budget] or evaluations[-1:]
        return {"tokens": budget * stop_at, "seconds": time.monotonic() - started, "loss": past[0]["loss"]}
    return {
        "tokens": budget,
        "versions": status.version,
        "seconds": time.monotonic() - started,
        **{f"loss_{fraction}": loss_at(evaluations, fraction * budget) for fraction in FRACTIONS},
        "evaluations": evaluations,
    }


def run_data_parallel(recipe: Recipe, learning_rate: float, fraction_of_budget: float) -> dict:
    """The baseline: one process, batch M*b, the same inner schedule and evaluation."""
    torch.manual_seed(recipe.training.seed)
    training = recipe.training
    model = recipe.model.build()
    split = TextSplit.of(load_text(recipe.data.source), recipe.data.heldout_fraction, recipe.data.sequence_length)
    heldout = evaluation_batches(
        split.heldout, training.batch_size, recipe.data.sequence_length, recipe.sync.evaluation_batches
    )
    batch = training.batch_size * training.num_learners
    steps = training.inner_steps  # each step sees M*b sequences: the same tokens as M learners' steps
    run_steps = max(1, round(steps * fraction_of_budget))
    optimizer = make_inner_optimizer(model, learning_rate, training.weight_decay, training.betas)
    schedule = InnerSchedule(learning_rate, training.warmup_steps, steps, training.final_learning_rate_fraction)
    generator = torch.Generator().manual_seed(training.seed)
    checkpoints = {round(steps * fraction): fraction for fraction in FRACTIONS}
    losses, started = {}, time.monotonic()
    for step in range(1, run_steps + 1):
        inputs, targets = random_batch(split.train, batch, recipe.data.sequence_length, generator)
        inner_step(model, optimizer, inputs, targets, schedule.learning_rate(step - 1), training.gradient_clip)
        if step in checkpoints:
            losses[f"loss_{checkpoints[step]}"] = evaluate(model, heldout)
    at_end = checkpoints.get(run_steps)
    losses["loss_end"] = losses[f"loss_{at_end}"] if at_end else evaluate(model, heldout)
    tokens = run_steps * batch * recipe.data.sequence_length
    return {"tokens": tokens, "seconds": time.monotonic() - started, "learning_rate": learning_rate, **losses}


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(row[key] for row in rows if key in row)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__, "a tiny model and budget, 2 learners (about a minute)")
    parser.add_argument("--tokens", type=float, default=10e6, help="token budget of the full run")
    parser.add_argument(
        "--seeds", type=int, default=2, help="seeds of the headline rows (data-parallel, Decoupled K=1)"
    )
    parser.add_argument("--other-seeds", type=int, default=1, help="seeds of the K=M rows")
    parser.add_argument(
        "--dp-learning-rates", default="3e-3,6e-3,1e-2", help="data-parallel's grid; one value skips tuning"
    )
    parser.add_argument(
        "--diloco-learning-rates",
        default="3e-3,6e-3,1e-2",
        help="the DiLoCo learners' inner learning rates to tune over",
    )
    parser.add_argument("--sync-intervals", default="10,25,50", help="the values of H to tune over")
    parser.add_argument("--tuning-fraction", type=float, default=0.125, help="budget fraction of each tuning run")
    parser.add_argument(
        "--rows",
        default="",
        help="comma-separated row labels to run (default: every row)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep the rows (and tuning) already in the result file; run the rest"
    )
    return parser.parse_args(argv)


def tune_data_parallel(
    args: argparse.Namespace, grid: list[float], tuning: list[dict], earlier_rate: float | None
) -> float:
    """Data-parallel's learning rate, tuned on a fraction of the budget (the grid's one
    value when it has one); ``tuning`` gains a row per rate tried."""
    args.evaluate_every = 1
    for learning_rate in grid if len(grid) > 1 and not tuning else []:
        result = run_data_parallel(recipe_for(args, 0, {}), learning_rate, args.tuning_fraction)
        tuning.append({"learning_rate": learning_rate, "loss": result["loss_end"]})
        print(f"  tuning data-parallel lr {learning_rate:g}: {result['loss_end']:.4f}", flush=True)
    best = min(tuning, key=lambda row: row["loss"])["learning_rate"] if tuning else grid[0]
    if earlier_rate is not None and best != earlier_rate:
        raise SystemExit(
            f"--resume: tuning chose lr {best:g} but the kept data-parallel rows used {earlier_rate:g}; "
            "rerun without --resume"
        )
    return best


def tune_diloco(args: argparse.Namespace, grid: list[tuple[float, int]], tuning: list[dict]) -> dict | None:
    """The DiLoCo learners' inner learning rate and H, tuned as data-parallel's (K=M, int4);
    ``tuning`` gains a row per setting tried.

    A quick run is over in seconds, before the syncer has evaluated much: an evaluation
    is labelled with the tokens the learners had trained when it was taken, so its
    first one past a fraction may still be of the initial weights.  Quick tuning runs
    therefore go to the end and read the final version's evaluation."""
    fraction = None if args.quick else args.tuning_fraction
    with tempfile.TemporaryDirectory(prefix="diloco-tuning-") as directory:
        for learning_rate, interval in grid if len(grid) > 1 else []:
            if any(t["learning_rate"] == learning_rate and t["sync_interval"] == interval for t in tuning):
                continue
            args.evaluate_every = 1
            recipe = recipe_for(
                args, 0, {"training": {"learning_rate": learning_rate}, "sync": {"sync_interval": interval}}
            )
            result = run_diloco(
                recipe, f"tune-{learning_rate:g}-{interval}".replace(".", "p"), Path(directory), stop_at=fraction
            )
            loss = result["loss"] if fraction is not None else result["evaluations"][-1]["loss"]
            tuning.append({"learning_rate": learning_rate, "sync_interval": interval, "loss": loss})
            print(f"  tuning DiLoCo K=M int4 lr {learning_rate:g} H {interval}: {loss:.4f}", flush=True)
    return min(tuning, key=lambda row: row["loss"]) if tuning else None


def diloco_rows_for(args: argparse.Namespace, default: Recipe, tuned_setting: dict | None) -> dict[str, tuple]:
    """Each DiLoCo row's recipe overrides and evaluation interval; the tuned rows where
    tuning chose other than the default recipe's settings."""
    fp32 = {"codec": "fp32", "zstd_level": 1}
    rows = {
        "DiLoCo K=M fp32": ({"sync": {"learner_codec": fp32, "update_codec": fp32}}, 2 if args.quick else 10),
        "DiLoCo K=M int4": ({}, 2 if args.quick else 10),
        "Decoupled K=1 grace int4": ({"sync": {"quorum": 1}}, 4 if args.quick else 40),
    }
    if tuned_setting is not None and (tuned_setting["learning_rate"], tuned_setting["sync_interval"]) != (
        default.training.learning_rate,
        default.sync.sync_interval,
    ):
        tuned = {
            "training": {"learning_rate": tuned_setting["learning_rate"]},
            "sync": {"sync_interval": tuned_setting["sync_interval"]},
        }
        rows[TUNED_SYNC] = (tuned, 2 if args.quick else 10)
        rows[TUNED_ASYNC] = (
            {"training": tuned["training"], "sync": {**tuned["sync"], "quorum": 1}},
            4 if args.quick else 40,
        )
    return rows


def plan_rows(
    args: argparse.Namespace, seeds: list[int], other_seeds: list[int], diloco_rows: dict
) -> list[tuple[str, int]]:
    """The (row, seed) runs, most informative first, or those ``--rows`` names."""
    plan = [(DATA_PARALLEL, seeds[0]), ("Decoupled K=1 grace int4", seeds[0]), ("DiLoCo K=M fp32", other_seeds[0])]
    plan += [("Decoupled K=1 grace int4", seed) for seed in seeds[1:]]
    plan += [] if args.quick else [("DiLoCo K=M int4", seed) for seed in other_seeds]
    plan += [(DATA_PARALLEL, seed) for seed in seeds[1:]] + [("DiLoCo K=M fp32", seed) for seed in other_seeds[1:]]
    plan += (
        [] if args.quick else [(label, other_seeds[0]) for label in (TUNED_SYNC, TUNED_ASYNC) if label in diloco_rows]
    )
    plan += [(TOKENS_ROW, other_seeds[0])]
    chosen = [label.strip() for label in args.rows.split(",") if label.strip()]
    unknown = sorted(set(chosen) - {DATA_PARALLEL, *diloco_rows, TOKENS_ROW})
    if unknown:
        raise SystemExit(f"--rows: no row named {', '.join(map(repr, unknown))}")
    return [step for step in plan if not chosen or step[0] in chosen]


def run_row(args: argparse.Namespace, label: str, seed: int, best: float, diloco_rows: dict, workdir: Path) -> dict:
    """One row's run at one seed: data-parallel at the tuned rate, or a DiLoCo run."""
    if label == DATA_PARALLEL:
        result = run_data_parallel(recipe_for(args, seed, {}), best, 1.0)
        result.pop("loss_end")
        return {"row": label, "seed": seed, **result}
    overrides, args.evaluate_every = diloco_rows[label]
    recipe = recipe_for(args, seed, overrides)
    name = "q-" + re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") + f"-{seed}"
    result = run_diloco(recipe, name, workdir)
    result.pop("evaluations")
    return {"row": label, "seed": seed, "outer_lr": recipe.outer_learning_rate, "quorum": recipe.quorum, **result}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(2)
    probe = recipe_for(argparse.Namespace(quick=args.quick, steps_per_learner=1, evaluate_every=1), 0, {})
    per_step = probe.training.num_learners * tokens_per_learner_step(probe)
    args.steps_per_learner = 40 if args.quick else round(args.tokens / per_step)
    seeds = [0] if args.quick else list(range(args.seeds))
    other_seeds = [0] if args.quick else list(range(args.other_seeds))
    grid = [6e-3] if args.quick else [float(value) for value in args.dp_learning_rates.split(",")]
    diloco_grid = (
        [(6e-3, 10), (6e-3, 20)]
        if args.quick
        else [
            (float(lr), int(h)) for lr in args.diloco_learning_rates.split(",") for h in args.sync_intervals.split(",")
        ]
    )
    settings = settings_of(args, per_step, seeds, other_seeds)
    rows, tuning, earlier_rate, diloco_tuning = earlier_results(args, settings) if args.resume else ([], [], None, [])
    best = tune_data_parallel(args, grid, tuning, earlier_rate)
    tuned_setting = tune_diloco(args, diloco_grid, diloco_tuning)
    # the rows; the JSON is rewritten after each, so a long run that is stopped early
    # still reports what it measured
    default = recipe_for(args, 0, {})
    diloco_rows = diloco_rows_for(args, default, tuned_setting)
    plan = plan_rows(args, seeds, other_seeds, diloco_rows)
    tuned = {
        "dp_tuning": tuning,
        "dp_learning_rate": best,
        "diloco_tuning": diloco_tuning,
        "diloco_tuned": tuned_setting,
    }
    path = None
    with tempfile.TemporaryDirectory(prefix="diloco-quality-") as directory:
        tokens_index, bytes_per_token = prepare_tokens(Path(directory))
        tokens_model = {"kwargs": {**default.model.kwargs, "vocabulary_size": TOKENS_VOCABULARY}}
        diloco_rows[TOKENS_ROW] = ({"model": tokens_model, "data": {"source": tokens_index}}, 2 if args.quick else 10)
        for label, seed in plan:
            if any(row["row"] == label and row["seed"] == seed for row in rows):
                continue
            rows.append(run_row(args, label, seed, best, diloco_rows, Path(directory)))
            if label == TOKENS_ROW:
                rows[-1]["bytes_per_token"] = bytes_per_token
            print(f"  {label} seed {seed}: {rows[-1]['loss_1.0']:.4f}", flush=True)
            path = write_result("quality", args.quick, settings, summarize(rows) | tuned, args.output)
    results = summarize(rows) | tuned
    table = [{"row": label, **values} for label, values in results["summary"].items()]
    print_table(table, ["row", "seeds", "loss_0.25", "loss_0.5", "loss_1.0", "bpb_1.0"])
    for name, value in results["gaps"].items():
        print(f"{name}: {value:+.2%}")
    print(f"wrote {path}" if path else "nothing left to run")
    return results


def earlier_results(
    args: argparse.Namespace, settings: dict
) -> tuple[list[dict], list[dict], float | None, list[dict]]:
    """The rows, tunings and data-parallel lr of the result file, if it measured the same settings."""
    path = result_path("quality", args.quick, args.output)
    if not path.exists():
        return [], [], None, []
    document = json.loads(path.read_text())
    same = (
        "tokens",
        "learners",
        "batch_per_learner",
        "sequence_length",
        "model",
        "inner_learning_rate",
        "sync_interval",
        "fragments",
    )
    changed = [key for key in same if document["settings"].get(key) != settings[key]]
    if changed:
        raise SystemExit(f"--resume: {path} measured other settings ({', '.join(changed)}); rerun without --resume")
    results = document["results"]
    dp_rows = [row for row in results["rows"] if row["row"] == DATA_PARALLEL]
    return (
        results["rows"],
        results["dp_tuning"],
        dp_rows[0]["learning_rate"] if dp_rows else None,
        results.get("diloco_tuning", []),
    )


def settings_of(args: argparse.Namespace, per_step: int, seeds: list[int], other_seeds: list[int]) -> dict:
    recipe = recipe_for(argparse.Namespace(**{**vars(args), "evaluate_every": 1}), 0, {})
    return {
        "tokens": args.steps_per_learner * per_step,
        "steps_per_learner": args.steps_per_learner,
        "learners": recipe.training.num_learners,
        "batch_per_learner": recipe.training.batch_size,
        "sequence_length": recipe.data.sequence_length,
        "model": recipe.model.model_dump(),
        "inner_learning_rate": recipe.training.learning_rate,
        "sync_interval": recipe.sync.sync_interval,
        "fragments": recipe.sync.num_fragments,
        "headline_seeds": seeds,
        "other_seeds": other_seeds,
    }


def summarize(rows: list[dict]) -> dict:
    """Mean losses per row over its seeds, and the relative gaps where both rows exist."""
    summary = {}
    for label in dict.fromkeys(row["row"] for row in rows):
        group = [row for row in rows if row["row"] == label]
        summary[label] = {f"loss_{f}": mean(group, f"loss_{f}") for f in FRACTIONS} | {"seeds": len(group)}
        per_token = group[0].get("bytes_per_token", 1.0)  # a byte is a token, but in the tokens row
        summary[label] |= {f"bpb_{f}": bits_per_byte(summary[label][f"loss_{f}"], per_token) for f in FRACTIONS}
    gaps, targets = {}, {}
    for name, better, baseline, target in (
        ("diloco_vs_dp", "DiLoCo K=M fp32", DATA_PARALLEL, TARGET_DILOCO_VS_DP),
        ("async_vs_sync", "Decoupled K=1 grace int4", "DiLoCo K=M fp32", TARGET_ASYNC_VS_SYNC),
        ("tuned_diloco_vs_dp", TUNED_SYNC, DATA_PARALLEL, TARGET_DILOCO_VS_DP),
        ("tuned_async_vs_sync", TUNED_ASYNC, TUNED_SYNC, TARGET_ASYNC_VS_SYNC),
    ):
        if better in summary and baseline in summary:
            gaps |= {
                f"{name}_{f}": summary[better][f"loss_{f}"] / summary[baseline][f"loss_{f}"] - 1 for f in FRACTIONS
            }
            measured = gaps[f"{name}_1.0"]
            targets[name] = {"target": f"<= {target}", "measured": measured, "met": measured <= target}
    return {"rows": rows, "summary": summary, "gaps": gaps, "targets": targets}


if __name__ == "__main__":
    main()
