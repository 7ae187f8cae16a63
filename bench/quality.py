"""Benchmark 3: is the global model as good as data-parallel's, at a real horizon?

The budget is 20 tokens per parameter (Chinchilla's; 16.8M tokens for the built-in
0.84M-parameter byte-level GPT).  Rows, each at its tuned settings:

- ``data-parallel``: one process with the global batch (the same mathematics as DDP over
  M workers), its learning rate and batch tuned;
- ``floor: one learner alone``: one learner on a quarter of the tokens, the share each
  of the M=4 learners trains: what a learner reaches without communicating, which every
  communicating method must beat;
- ``DiLoCo M=1 K=M`` ... ``DiLoCo M=8 K=M``: the real learners, reducers and syncer
  (``diloco up`` on this machine, ``file://`` buckets), the batch per learner fixed;
- ``Decoupled K=1 of 4``: the grace window, through the reducers, the default codecs;
- ``Decoupled K=1 of 4, recipes/wan.yaml``: the same with the WAN recipe's H and codecs;
- ``DiLoCo M=4 K=M on BPE tokens``: the same model on a 512-token BPE that ``diloco
  prepare`` trains, compared in bits per byte.

Both sides are tuned the same way (``bench/quality_tuning.py``): one setting at a time at
an eighth of the budget, on the full run's schedule.  Every row reports its losses at a
quarter, half and all of its budget, its gap to data-parallel's final loss, and the
tokens it needs to reach that loss; a headline row that has not reached it by the budget
gets a run on twice the budget (``... to 2x budget``).  A row whose final loss is not
below the floor's fails, whatever else it shows.

    python -m bench.quality                  # the full form: several hours, in sittings
    python -m bench.quality --resume         # keep what the result file has, run the rest
    python -m bench.quality --rows "data-parallel; DiLoCo M=4 K=M" --resume
    python -m bench.quality --quick          # a tiny model and budget, 2 learners (the tests)

Every finished trial and row is written at once, so a sitting that is stopped loses only
the run in progress.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch
import yaml

from bench._common import benchmark_parser, print_table, result_path, write_result
from bench.quality_levers import (
    DATA_PARALLEL_LEVERS,
    LEVER_FRACTION,
    LEVER_GAIN,
    LEVERS,
    LOCKSTEPS,
    REPEATS,
    adopted,
    chosen_levers,
    lever_changes,
    lever_of,
    lever_ratios,
    lever_record,
    levers_at,
    merged,
    yardstick,
)
from bench.quality_runs import (
    InProcess,
    Lockstep,
    diloco_tokens,
    loss_at,
    prepare_tokens,
    train_diloco,
    train_in_process,
    train_lockstep,
)
from bench.quality_summary import (
    DATA_PARALLEL,
    EXTENDED,
    FLOOR,
    SEEDS_WITHIN_SPREAD,
    Rows,
    losses_of,
    summarize,
    targets_of,
)
from bench.quality_tuning import DATA_PARALLEL_SIDE, DILOCO_SIDE, Setting, full_knobs, quick_knobs, tune
from diloco_cli.config.recipe import Recipe

TOKENS_PER_PARAMETER = 20
TOKENS_VOCABULARY = 512
"""The BPE vocabulary of the tokens row: at width 128 its embedding adds 33K parameters."""
WAN_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "wan.yaml"
WAN_KEYS = ("sync_interval", "sync_interval_schedule", "num_fragments", "learner_codec", "update_codec")
"""What the WAN recipe row takes from ``recipes/wan.yaml``: its schedule and codecs."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__, "a tiny model and budget, 2 learners (about two minutes)")
    parser.add_argument(
        "--tokens", type=float, help=f"token budget (default: {TOKENS_PER_PARAMETER} tokens per parameter)"
    )
    parser.add_argument("--seeds", type=int, default=2, help="seeds of data-parallel, the floor, M=4 and K=1")
    parser.add_argument("--other-seeds", type=int, default=1, help="seeds of the other rows")
    parser.add_argument("--tuning-fraction", type=float, default=0.125, help="budget fraction of each tuning run")
    parser.add_argument(
        "--rows",
        default="",
        help="the row names to run, separated by semicolons (names hold commas; default: every row)",
    )
    parser.add_argument(
        "--levers",
        nargs="?",
        const="",
        metavar="NAMES",
        help="try the levers that may close the gap on the tuned M=4 K=M run instead of the rows: every lever, or "
        "those named (separated by semicolons: names hold commas)",
    )
    parser.add_argument(
        "--lever-fraction",
        type=float,
        default=LEVER_FRACTION,
        help=f"budget fraction of a lever run (default {LEVER_FRACTION}; at 1 the tuned run is the M=4 row's seed 0)",
    )
    parser.add_argument(
        "--adopt",
        metavar="LEVERS",
        help="the levers the rows run (separated by semicolons), whatever --levers measured (default: those "
        f"that beat the tuned run by more than {LEVER_GAIN * 100:.0f}%%)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows, tuning trials and levers in the result file (a row measured at other settings than "
        "are chosen now moves to superseded_rows, and is rerun); run the rest",
    )
    return parser.parse_args(argv)


def base_recipe(quick: bool) -> Recipe:
    """The default recipe, shrunk to a tiny model and 2 learners for the quick form."""
    base: dict = {"name": "quality", "training": {"heartbeat_seconds": 1.0}}
    if quick:
        base["model"] = {"kwargs": {"num_layers": 2, "width": 64, "num_heads": 2, "context": 64}}
        base["data"] = {"sequence_length": 64}
        base["training"] |= {"num_learners": 2, "batch_size": 8, "warmup_steps": 5, "poll_seconds": 0.3}
        base["training"]["heartbeat_seconds"] = 0.5
        base["sync"] = {"sync_interval": 10, "evaluation_batches": 2}
    return Recipe.model_validate(base)


def default_setting(recipe: Recipe) -> Setting:
    """Where tuning starts: the recipe's settings, data-parallel at the global batch."""
    training, sync = recipe.training, recipe.sync
    return Setting(
        dp_learning_rate=training.learning_rate,
        dp_batch=training.batch_size * training.num_learners,
        inner_learning_rate=training.learning_rate,
        outer_learning_rate=recipe.outer_learning_rate,
        outer_momentum=sync.outer_momentum,
        sync_interval=sync.sync_interval,
        batch_per_learner=training.batch_size,
        install="keep-unsent" if recipe.keeps_unsent_work else "overwrite",
    )


def diloco_recipe(
    base: Recipe, setting: Setting, seed: int, tokens: float, learners: int, quorum: int | None = None, **sections
) -> Recipe:
    """``base`` at ``setting`` with ``learners`` (K = ``quorum`` or M) training ``tokens``
    in all; ``sections`` override the recipe's sections (a dict each).  The outer
    learning rate for K < M is the K=M one scaled as ``auto`` scales it, by sqrt(K/M);
    the syncer evaluates about 32 times in the run."""
    length = base.data.sequence_length
    steps = max(1, round(tokens / (learners * setting.batch_per_learner * length)))
    quorum = quorum or learners
    sections = merged(lever_changes(setting.levers, setting, steps)[1], sections)
    sync = sections.pop("sync", {})
    interval = sync.get("sync_interval", setting.sync_interval)
    versions = steps / interval * sync.get("num_fragments", base.sync.num_fragments) * learners / quorum
    document = json.loads(base.model_dump_json())
    document["training"] |= {
        "seed": seed,
        "num_learners": learners,
        "inner_steps": steps,
        "learning_rate": setting.inner_learning_rate,
        "batch_size": setting.batch_per_learner,
    }
    document["sync"] |= {
        "sync_interval": setting.sync_interval,
        "quorum": quorum,
        "outer_learning_rate": setting.outer_learning_rate * math.sqrt(quorum / learners),
        "outer_momentum": setting.outer_momentum,
        "install": setting.install if quorum == learners else "auto",
        "evaluate_every": max(1, round(versions / 32)),
        **sync,
    }
    for section, values in sections.items():
        document[section] |= values
    return Recipe.model_validate(document)


def wan_sync() -> dict:
    """``recipes/wan.yaml``'s schedule and codecs."""
    sync = yaml.safe_load(WAN_RECIPE.read_text()).get("sync", {})
    return {key: sync[key] for key in WAN_KEYS if key in sync}


def budget_of(args: argparse.Namespace, base: Recipe) -> float:
    if args.tokens:
        return args.tokens
    if args.quick:
        return 2 * 40 * 8 * 64  # 2 learners, 40 steps of 8 sequences of 64 bytes
    return TOKENS_PER_PARAMETER * sum(p.numel() for p in base.model.build().parameters())


class Quality:
    """One sitting of the benchmark: its settings, its workdir, what it has measured."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.base = base_recipe(args.quick)
        self.rows = Rows(self.base.training.num_learners, args.quick)
        self.budget = budget_of(args, self.base)
        self.tokens_dataset: tuple[str, float] | None = None

    def trial(self, side: str, setting: Setting) -> dict:
        """One tuning run: the full run's schedule, stopped at the tuning fraction (quick
        DiLoCo runs are over before the syncer evaluated much: they go to their end)."""
        fraction = self.args.tuning_fraction
        if side == DATA_PARALLEL_SIDE:
            run = InProcess(setting.dp_learning_rate, setting.dp_batch, self.budget, stop=fraction)
            result = train_in_process(diloco_recipe(self.base, setting, 0, self.budget, self.rows.learners), run)
            return {"loss": result["evaluations"][-1][1], "seconds": result["seconds"]}
        recipe = diloco_recipe(self.base, setting, 0, self.budget, self.rows.learners)
        name = f"tune-{len(list(self.workdir.glob('tune-*.json')))}"
        result = train_diloco(recipe, name, self.workdir, stop=1.0 if self.args.quick else fraction)
        evaluations = result["evaluations"]
        loss = evaluations[-1][1] if self.args.quick else loss_at(evaluations, fraction * diloco_tokens(recipe))
        return {"loss": loss, "seconds": result["seconds"]}

    def run_row(self, label: str, seed: int, setting: Setting) -> dict:
        """One row at one seed: its curve, its losses at the fractions of its budget."""
        rows, budget = self.rows, self.budget
        extended = label.endswith(EXTENDED)
        name = label.removesuffix(EXTENDED)
        tokens = budget * (2 if extended else 1)
        recipe = diloco_recipe(self.base, setting, seed, tokens, rows.learners)
        record: dict = {"row": label, "seed": seed, "setting": asdict(setting)}
        if name == DATA_PARALLEL:
            result = train_in_process(recipe, InProcess(setting.dp_learning_rate, setting.dp_batch, tokens))
        elif name == FLOOR:
            run = InProcess(setting.inner_learning_rate, setting.batch_per_learner, tokens / rows.learners)
            result = train_in_process(recipe, run)
        else:
            recipe = self.row_recipe(name, setting, seed, tokens)
            record |= {"learners": recipe.training.num_learners, "quorum": recipe.quorum}
            record |= {"outer_lr": recipe.outer_learning_rate, "outer_momentum": recipe.sync.outer_momentum}
            slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
            result = train_diloco(recipe, f"q-{slug}-{seed}", self.workdir)
        record |= result
        record |= losses_of(result["evaluations"], result["tokens"])
        if name == rows.tokens:
            record["bytes_per_token"] = self.tokens_dataset[1]
        return record

    def row_recipe(self, name: str, setting: Setting, seed: int, tokens: float) -> Recipe:
        rows, base = self.rows, self.base
        if name == rows.decoupled:
            return diloco_recipe(base, setting, seed, tokens, rows.learners, quorum=1)
        if name == rows.wan:
            return diloco_recipe(base, setting, seed, tokens, rows.learners, quorum=1, sync=wan_sync())
        if name == rows.tokens:
            if self.tokens_dataset is None:
                self.tokens_dataset = prepare_tokens(self.workdir, TOKENS_VOCABULARY)
            model = {"kwargs": {**base.model.kwargs, "vocabulary_size": TOKENS_VOCABULARY}}
            data = {"source": self.tokens_dataset[0]}
            return diloco_recipe(base, setting, seed, tokens, rows.learners, model=model, data=data)
        learners = int(re.fullmatch(r"DiLoCo M=(\d+) K=M", name).group(1))
        return diloco_recipe(base, setting, seed, tokens, learners)

    def lever(self, name: str, setting: Setting) -> dict:
        """One lever (or ``tuned``, the baseline) on the tuned M=4 K=M run at seed 0,
        stopped at ``--lever-fraction`` of the budget (quick runs go to their end)."""
        learners = self.rows.learners
        stop = 1.0 if self.args.quick else self.args.lever_fraction
        steps = diloco_recipe(self.base, setting, 0, self.budget, learners).training.inner_steps
        if name in DATA_PARALLEL_LEVERS:
            changed = DATA_PARALLEL_LEVERS[name](setting)
            run = InProcess(changed.dp_learning_rate, changed.dp_batch, self.budget, stop=stop)
            result = train_in_process(diloco_recipe(self.base, setting, 0, self.budget, learners), run)
            return lever_record(name, stop, setting, changed, {}, result, result["tokens"])
        if measured := yardstick(name, setting, steps):
            options, changed, sections = measured
            run = Lockstep(
                learners,
                changed.inner_learning_rate,
                changed.batch_per_learner,
                changed.sync_interval,
                changed.outer_learning_rate,
                changed.outer_momentum,
                self.budget,
                stop,
                **options,
            )
            result = train_lockstep(diloco_recipe(self.base, changed, 0, self.budget, learners), run)
            return lever_record(name, stop, setting, changed, sections, result, result["tokens"])
        names = () if name == "tuned" or name in REPEATS else tuple(lever_of(name).split(" + "))
        changed, sections = lever_changes(names, setting, steps)
        recipe = diloco_recipe(self.base, replace(changed, levers=names), 0, self.budget, learners)
        result = train_diloco(recipe, f"lever-{len(list(self.workdir.glob('lever-*.json')))}", self.workdir, stop=stop)
        return lever_record(name, stop, setting, changed, sections, result, diloco_tokens(recipe))

    def settings(self) -> dict:
        """What a result measured: a resumed sitting must measure the same."""
        return {
            "tokens": self.budget,
            "tokens_per_parameter": None if self.args.tokens or self.args.quick else TOKENS_PER_PARAMETER,
            "learners": self.rows.learners,
            "sequence_length": self.base.data.sequence_length,
            "model": self.base.model.model_dump(),
            "tuning_fraction": self.args.tuning_fraction,
            "seeds": self.args.seeds,
            "other_seeds": self.args.other_seeds,
        }

    def plan(self, done: list[dict], summary: dict) -> list[tuple[str, int]]:
        """The (row, seed) runs still to do, most informative first, within ``--rows``;
        a headline row that ends above data-parallel's loss gets its run on twice the
        budget once its own runs are in."""
        rows, args = self.rows, self.args
        seeds = [0] if args.quick else list(range(args.seeds))
        others = [0] if args.quick else list(range(args.other_seeds))
        headline = [DATA_PARALLEL, FLOOR, rows.sync, rows.decoupled]
        plan = [(label, seed) for seed in seeds for label in headline]
        plan += [(rows.of_size(m), seed) for m in rows.sizes if m != rows.learners for seed in others]
        plan += [(label, seed) for label in rows.recipe_rows for seed in others]
        target = summary.get(DATA_PARALLEL, {}).get("loss_1.0")
        behind = [
            label for label in rows.headline if summary.get(label, {}).get("loss_1.0", -math.inf) > (target or math.inf)
        ]
        plan += [(label + EXTENDED, 0) for label in behind]
        chosen = [label.strip() for label in args.rows.split(";") if label.strip()]
        unknown = sorted(set(chosen) - set(rows.all()))
        if unknown:
            raise SystemExit(f"--rows: no row named {', '.join(map(repr, unknown))}; the rows: {', '.join(rows.all())}")
        finished = {(row["row"], row["seed"]) for row in done}
        return [step for step in plan if step not in finished and (not chosen or step[0] in chosen)]


def run_levers(quality: Quality, setting: Setting, levers: list[dict], rows: list[dict], save) -> None:
    """Each lever (``--levers``' names, or all) not yet tried at ``setting`` and
    ``--lever-fraction``, the tuned run it is compared with (at the full budget, the M=4
    row's seed 0: the same run), and the winners together."""
    args = quality.args
    fraction = 1.0 if args.quick else args.lever_fraction

    def measured(name: str) -> bool:
        return any(lever["lever"] == name for lever in levers_at(levers, setting, fraction))

    def run(name: str) -> None:
        levers.append(quality.lever(name, setting))
        print(f"  lever {name}: {levers[-1]['loss']:.4f}", flush=True)
        save(setting)

    row = next(
        (r for r in rows if (r["row"], r["seed"]) == (quality.rows.sync, 0) and Setting.of(r["setting"]) == setting),
        None,
    )
    if not measured("tuned") and fraction == 1.0 and row is not None:
        record = {"sections": {}, "changes": {}, "setting": asdict(setting), "seconds": row["seconds"]}
        levers.append({"lever": "tuned", "fraction": 1.0, "loss": row["loss_1.0"], "from_row": row["row"]} | record)
        levers[-1]["evaluations"] = row["evaluations"]
    yardsticks = (*LOCKSTEPS, *DATA_PARALLEL_LEVERS, *REPEATS)
    names = adopted(args.levers, *yardsticks) if args.levers else (*LEVERS, *yardsticks)
    for name in ["tuned", *names]:
        if not measured(name):
            run(name)
    ratios = lever_ratios(levers, setting)
    winners = sorted(name for name in LEVERS if ratios.get(name, 1.0) < 1 - LEVER_GAIN)
    if len(winners) > 1 and " + ".join(winners) not in ratios:
        run(" + ".join(winners))
    for fraction_measured in {lever.get("fraction", LEVER_FRACTION) for lever in levers}:
        group = levers_at(levers, setting, fraction_measured)
        tuned = next((lever["loss"] for lever in group if lever["lever"] == "tuned"), None)
        data_parallel = data_parallel_loss(rows, setting, fraction_measured)
        for lever in group:
            if lever["lever"] in DATA_PARALLEL_LEVERS:
                lever["vs_data_parallel"] = data_parallel and lever["loss"] / data_parallel - 1
            else:
                lever["vs_tuned"] = tuned and lever["loss"] / tuned - 1


def data_parallel_loss(rows: list[dict], setting: Setting, fraction: float) -> float | None:
    """Data-parallel's loss at ``fraction`` of its budget in its row at seed 0 with
    ``setting``'s data-parallel fields: what its yardsticks are compared with."""

    def same_side(row: dict) -> bool:
        return Setting.of(row["setting"]).of_side(DATA_PARALLEL_SIDE) == setting.of_side(DATA_PARALLEL_SIDE)

    row = next((r for r in rows if (r["row"], r["seed"]) == (DATA_PARALLEL, 0) and same_side(r)), None)
    return None if row is None else loss_at(row["evaluations"], fraction * row["tokens"])


def earlier_results(args: argparse.Namespace, settings: dict) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """The rows, tuning trials, levers and superseded rows of the result file, if it
    measured the same settings."""
    path = result_path("quality", args.quick, args.output)
    if not path.exists():
        return [], [], [], []
    document = json.loads(path.read_text())
    changed = [
        key
        for key in ("tokens", "learners", "sequence_length", "model", "tuning_fraction")
        if document["settings"].get(key) != settings[key]
    ]
    if changed:
        raise SystemExit(f"--resume: {path} measured other settings ({', '.join(changed)}); rerun without --resume")
    results = document["results"]
    rows = [row | losses_of(row["evaluations"], row["tokens"]) for row in results["rows"]]
    levers = [lever for lever in results.get("levers", []) if "evaluations" in lever]  # read at one point: rerun
    return rows, results.get("tuning", []), levers, results.get("superseded_rows", [])


POLLS = {"poll_seconds", "awaiting_poll_seconds"}
"""The training section's keys that only a syncing learner reads."""


def depends_on(label: str, setting: Setting) -> tuple:
    """What a row's runs depend on: data-parallel's setting, or a learner's (the floor),
    or DiLoCo's; each with the levers it takes (the training section's are everyone's,
    for both methods run the same inner optimizer and schedule, but for the learner's
    polls: neither data-parallel nor the floor syncs)."""
    everyone = tuple(name for name in setting.levers if set(LEVERS[name](setting, 1).get("training", {})) - POLLS)
    if label == DATA_PARALLEL:
        return (*setting.of_side(DATA_PARALLEL_SIDE).items(), everyone)
    if label == FLOOR:
        return (setting.inner_learning_rate, setting.batch_per_learner, everyone)
    return (*setting.of_side(DILOCO_SIDE).items(), setting.levers)


def stale_rows(rows: list[dict], setting: Setting) -> list[dict]:
    """The kept rows measured at other settings than those they depend on now."""
    return [
        row for row in rows if depends_on(row["row"], Setting.of(row["setting"])) != depends_on(row["row"], setting)
    ]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="diloco-quality-") as directory:
        quality = Quality(args, Path(directory))
        settings = quality.settings()
        rows, trials, levers, superseded = earlier_results(args, settings) if args.resume else ([], [], [], [])

        def results(setting: Setting | None) -> dict:
            summary = summarize(rows, quality.rows, superseded)
            return {
                "target_source": DATA_PARALLEL,
                "summary": summary,
                "targets": targets_of(summary, quality.rows),
                "tuned": setting and asdict(setting),
                "tuning": trials,
                "levers": levers,
                "levers_chosen_by": "--adopt"
                if args.adopt is not None
                else f"beating the tuned run by {LEVER_GAIN:.0%}",
                "rows": rows,
                "superseded_rows": superseded,
            }

        def save(setting: Setting | None = None) -> Path:
            return write_result("quality", args.quick, settings, results(setting), args.output)

        knobs = quick_knobs() if args.quick else full_knobs()
        setting = tune(default_setting(quality.base), knobs, trials, quality.trial, after=save)
        if args.levers is not None:
            run_levers(quality, setting, levers, rows, save)
        steps = diloco_recipe(quality.base, setting, 0, quality.budget, quality.rows.learners).training.inner_steps
        chosen = adopted(args.adopt) if args.adopt is not None else chosen_levers(levers, setting)
        setting = replace(lever_changes(chosen, setting, steps)[0], levers=chosen)
        for row in stale_rows(rows, setting):  # kept beside the rows they are rerun for
            print(f"  {row['row']} seed {row['seed']}: measured at another setting, superseded", flush=True)
            rows.remove(row)
            superseded.append(row)
        while args.levers is None and (plan := quality.plan(rows, summarize(rows, quality.rows))):
            label, seed = plan[0]
            rows.append(quality.run_row(label, seed, setting))
            print(f"  {label} seed {seed}: {rows[-1]['loss_1.0']:.4f} ({rows[-1]['seconds']:.0f} s)", flush=True)
            save(setting)
        path = save(setting)
    report = results(setting)
    table = [
        {**entry, "row": label + (" (an earlier setting)" if "measured_at" in entry else "")}
        for label, entry in report["summary"].items()
    ]
    columns = ["row", "seeds", "loss_0.25", "loss_0.5", "loss_1.0", "gap_vs_dp", "token_overhead", "install_lag_steps"]
    print_table(table, [*columns, "seconds"])
    for name, target in report["targets"].items():
        verdict = "met" if target["met"] else "MISSED"
        if target.get("met_by") == "twice the spread":
            verdict += f" only within twice the spread ({target['spread']:.1%}, {target['seeds']} seeds)"
            verdict += f"; {SEEDS_WITHIN_SPREAD} seeds of each row are due" if target["seeds_due"] else ""
        if earlier := target.get("measured_at_an_earlier_setting"):
            verdict += f"; {' and '.join(earlier)} measured at an earlier setting"
        print(f"{name}: {target.get('measured', target.get('failing'))} ({target['target']}): {verdict}")
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
