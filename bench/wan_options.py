"""The command line of ``bench.wan``: the race's options, the sweep's, and what they refuse."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import yaml

from bench._common import benchmark_parser
from bench.wan_diloco import REGIONS, SYNCER
from bench.wan_sweep import LABELS

TARGET_COMM_TO_COMPUTE = 30.0
"""A data-parallel step on the WAN communicates this many times longer than it computes
(the source's 12B model on 2-5 Gbit/s, scaled down): the links' rate follows."""


def parse_args(doc: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """``bench.wan``'s command line (``doc``: its module docstring), checked."""
    parser = benchmark_parser(doc, "a tiny model and budget, 2 regions x 1 learner (~1 minute)")
    add_race_options(parser)
    add_sweep_options(parser)
    parser.add_argument(
        "--keep", action="store_true", help="keep the working directory (logs, runs) and print where it is"
    )
    args = parser.parse_args(argv)
    if (args.sweep or args.sweep_from or args.check_link_rate) and args.quick:
        parser.error("--sweep, --sweep-from and --check-link-rate are for the full mode only")
    if args.learners is not None and (args.learners < 2 or args.learners % len(REGIONS)):
        parser.error(f"--learners {args.learners}: give a multiple of {len(REGIONS)}, one share per region")
    if args.replan and (args.settings or not args.sweep_from):
        parser.error("--replan plans the rows of an earlier sweep again: give --sweep-from RESULT, no --settings")
    if args.longer <= 1:
        parser.error(f"--longer {args.longer:g}: give a factor above 1 (the budget's run is the first)")
    if args.settings and not args.sweep_from:
        parser.error("--settings reruns settings of an earlier sweep: give --sweep-from RESULT")
    return args


def recipe_overrides(path: Path | None) -> list[str]:
    """A recipe file as the ``--set`` overrides it makes over the default recipe (each
    leaf of its YAML as ``section.key=value``), so every run of the race (data-parallel's
    ranks, the learners, the plan) takes it the one way they take overrides."""
    if path is None:
        return []
    document = yaml.safe_load(path.read_text())
    if not isinstance(document, dict):
        raise SystemExit(f"--recipe {path}: not a recipe (a YAML mapping of sections)")

    def leaves(node: dict, prefix: str) -> list[str]:
        found = []
        for key, value in node.items():
            if isinstance(value, dict) and value:
                found += leaves(value, f"{prefix}{key}.")
            else:  # JSON is YAML: strings, numbers, lists and null read back as they were
                found.append(f"{prefix}{key}={json.dumps(value)}")
        return found

    return leaves(document, "")


def add_race_options(parser: argparse.ArgumentParser) -> None:
    """The race's options: the recipe and the reference, the WAN (latency, link rate), the
    runs, the learners and where the syncer runs."""
    parser.add_argument(
        "--recipe",
        type=Path,
        help="the recipe both methods train (default: the default recipe's 300-step demo), e.g. "
        "recipes/wan.yaml at 20 tokens per parameter",
    )
    parser.add_argument(
        "--reference",
        type=Path,
        help="a bench.quality result (bench/results/quality.json) of the same model, tokens, batch and learning "
        "rate: the target is its tuned data-parallel's final loss (the mean of its seeds' curves) and the floor its "
        "floor row; data-parallel on loopback then runs --calibration-steps only, for c and B",
    )
    parser.add_argument(
        "--calibration-steps",
        type=int,
        default=60,
        help="with --reference: data-parallel's steps on loopback that measure c and B (default 60)",
    )
    parser.add_argument(
        "--latency-ms", type=float, default=40.0, help="one-way latency the proxies add in front of each remote S3"
    )
    parser.add_argument(
        "--comm-ratio",
        type=float,
        default=TARGET_COMM_TO_COMPUTE,
        help="the link rate makes a data-parallel step communicate this many times longer than it computes",
    )
    parser.add_argument("--link-mbit", type=float, help="use this link rate instead of the calibrated one")
    parser.add_argument(
        "--dp-wan-seconds",
        type=float,
        help="training seconds of data-parallel on the WAN (default 60; quick: 3 steps instead)",
    )
    parser.add_argument(
        "--dp-eval-every", type=int, help="data-parallel (loopback) evaluates every E steps (default 10; quick 5)"
    )
    parser.add_argument("--timeout", type=float, help="seconds any one run may take (default 3600; quick 240)")
    parser.add_argument(
        "--longer",
        type=float,
        default=2.0,
        help="where DiLoCo's run at the budget never reaches data-parallel's final loss, run it again on a schedule "
        "of this many times the budget's inner steps, stopped at its first evaluation at or below it (default 2)",
    )
    parser.add_argument(
        "--diloco-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=(
            "a recipe override for the DiLoCo run (and the plan) only, e.g. sync.update_codec.codec=int4 (repeatable): "
            "a setting named for a slow WAN"
        ),
    )
    parser.add_argument(
        "--learners",
        type=int,
        help="learners (data-parallel ranks) in all, split evenly between the two regions: 8 for 2 x 4 "
        "(default: the recipe's 4; quick 2)",
    )
    parser.add_argument(
        "--syncer-in",
        default=REGIONS[0],
        choices=[*REGIONS, SYNCER],
        help=f"where the syncer runs: a region (default {REGIONS[0]!r}, as a default run places it) or {SYNCER!r}, "
        "a place of its own behind its own link (the placement before reducers)",
    )


def add_sweep_options(parser: argparse.ArgumentParser) -> None:
    """The options of what follows the race: the settings sweep and the link-rate check (full mode)."""
    parser.add_argument(
        "--sweep", action="store_true", help="also the settings sweep of WAN bytes per token (full mode only)"
    )
    parser.add_argument(
        "--check-link-rate",
        action="store_true",
        help="also run DiLoCo at the plan's link rate for 90%% computing and at half of it (full mode only)",
    )
    parser.add_argument(
        "--sweep-from",
        type=Path,
        metavar="RESULT",
        help="run only the sweep, against the data-parallel results of an earlier full run's JSON (written back there)",
    )
    parser.add_argument(
        "--settings",
        action="append",
        default=[],
        choices=LABELS,
        metavar="SETTING",
        help="with --sweep-from: run only this setting of the sweep (repeatable), keeping the others' rows",
    )
    parser.add_argument(
        "--replan",
        action="store_true",
        help="with --sweep-from: run no setting, plan each row again at this commit (from its learners' step and "
        "start-up) beside what it measured",
    )
