"""``diloco simulate goodput``: the calibration holds, the trends follow from the model,
closed forms agree with the event simulation, and the command line shows and takes every
constant."""

import json
import math
import random

import pytest
from click.testing import CliRunner

from diloco_cli.cli.app import app
from diloco_cli.simulate import GoodputConstants, simulate_grid
from diloco_cli.simulate.cluster import Cluster
from diloco_cli.simulate.constants import SOURCE_GOODPUT
from diloco_cli.simulate.grid import Strategy, closed_form_goodput, simulate_cell
from diloco_cli.simulate.restarting import simulate_restarting

runner = CliRunner()
SMALL = ["--chips", "150k", "--learners", "2", "--set", "horizon_days=0.5", "--set", "replicas=1"]


def test_the_source_figures_hold_at_1_2m_chips():
    """At 1.2M chips and one year per chip: plain 27%, elastic 58%, DiLoCo M=8 88%
    (arXiv 2604.21428), each within 2 points."""
    constants = GoodputConstants()
    for name, strategy in (
        ("plain", Strategy("plain")),
        ("elastic", Strategy("elastic")),
        ("diloco M=8", Strategy("diloco", 8)),
    ):
        cell = simulate_cell(1_200_000, strategy, constants, seed=0)
        assert cell.goodput == pytest.approx(SOURCE_GOODPUT[name], abs=0.02), name
        assert cell.goodput == pytest.approx(cell.closed_form_goodput, abs=0.01), name


@pytest.fixture(scope="module")
def grid():
    return simulate_grid(GoodputConstants(horizon_days=2, replicas=1), seed=1)


def test_plain_falls_with_size_and_diloco_rises_with_learners(grid):
    plain = [grid.cell(chips, "plain").goodput for chips in grid.chips]
    assert plain == sorted(plain, reverse=True) and 0.65 < plain[0] < 0.76 and 0.1 < plain[-1] < 0.2
    for chips in grid.chips:
        diloco = [grid.cell(chips, f"diloco M={m}").goodput for m in (1, 2, 4, 8, 16)]
        assert diloco == sorted(diloco), chips


def test_at_scale_diloco_beats_elastic_beats_plain(grid):
    for chips in (1_200_000, 2_400_000):
        elastic, plain = grid.cell(chips, "elastic"), grid.cell(chips, "plain")
        assert elastic.goodput > plain.goodput
        for m in (2, 4, 8, 16):
            assert grid.cell(chips, f"diloco M={m}").goodput > elastic.goodput
        assert grid.cell(chips, "diloco M=16").uptime > 0.99  # some learner is always training


def test_no_failures_leave_exactly_the_checkpoint_overhead():
    """90 s of training, then a 10 s checkpoint, for a day: 90% exactly; nothing else
    costs anything."""
    quiet = GoodputConstants(
        mtbi_chip_hours=math.inf,
        spare_fraction=0,
        checkpoint_interval_seconds=90,
        checkpoint_seconds=10,
        horizon_days=1,
        replicas=1,
    )
    assert simulate_cell(6400, Strategy("plain"), quiet, seed=0).goodput == pytest.approx(0.9, rel=1e-12)
    assert simulate_cell(6400, Strategy("elastic"), quiet, seed=0).goodput == pytest.approx(1.0, rel=1e-12)
    assert simulate_cell(6400, Strategy("diloco", 4), quiet, seed=0).goodput == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize(("groups", "save"), [([90], 30.0), ([90], 0.0), ([30, 30, 30], 0.0)])
def test_a_restarting_job_matches_the_renewal_formula(groups, save):
    """Each group is interrupted at rate lam (ample spares, so it never waits); it keeps
    segments of tau = 300 s training + ``save`` s and restarts in R = 600 s, a slice that
    fails during the restart being swapped within it (the group is down already).  A
    renewal argument gives the expected wall time per kept segment, (exp(lam (tau +
    save)) - 1) (1 / lam + R), so the goodput is the groups' share of the cluster times
    tau over that.  (A restart that started over when hit would give exp(lam R) / lam in
    place of 1 / lam + R: for the group of 90 slices lam R = 1, so e against 2.)"""
    slices, tau, restart = 100, 300.0, 600.0
    mtbi_seconds = 90 * 64 * 600.0  # 90 slices of 64 chips: one interruption every 600 s
    cluster = Cluster(
        slices=slices,
        slice_chips=64,
        slice_failure_rate=64 / mtbi_seconds,
        repair_seconds=36.0,
        horizon_seconds=200 * 86400.0,
    )
    outcome = simulate_restarting(cluster, groups, tau, save, restart, random.Random(7))
    expected = 0.0
    for size in groups:
        rate = size * 64 / mtbi_seconds
        expected += size / slices * tau * rate / ((1 + rate * restart) * math.expm1(rate * (tau + save)))
    assert outcome.interruptions == pytest.approx(cluster.horizon_seconds / 600 * 100 / 90, rel=0.03)
    assert outcome.goodput == pytest.approx(expected, abs=0.005)  # about 4 standard deviations of one replica


def test_an_elastic_job_pauses_once_for_the_changes_that_come_together():
    """Failures and repairs change the membership at rate c (2 x slices up x lam, in the
    steady state); a change stops the job for E seconds and the changes that come during
    that pause are taken by it.  The job trains for 1/c on average, then pauses E: it is
    up 1 / (1 + cE) of the time (a pause that a change started over, or followed with one
    more, would leave it up 1 / (1 + cE exp(cE)): 0.55 against 0.67 here, cE being 0.5)."""
    from diloco_cli.simulate.elastic import simulate_elastic

    slices, pause, repair = 1000, 25.0, 400.0
    rate = 1 / 100_000  # per slice: 1000 slices, an interruption every 100 s
    cluster = Cluster(
        slices=slices, slice_chips=64, slice_failure_rate=rate, repair_seconds=repair, horizon_seconds=100 * 86400.0
    )
    outcome = simulate_elastic(cluster, pause, random.Random(3))
    in_repair = rate * repair / (1 + rate * repair)
    changes = 2 * slices * (1 - in_repair) * rate
    assert changes * pause == pytest.approx(0.5, rel=0.01)
    assert outcome.uptime == pytest.approx(1 / (1 + changes * pause), abs=0.005)
    assert outcome.goodput == pytest.approx((1 - in_repair) * outcome.uptime, abs=0.005)


def test_the_curves_fall_as_one_over_one_plus_failure_rate_times_cost():
    """How the source's cells fall with size (arXiv 2604.21428; the issue that compared
    them): plain and elastic data-parallel lose less at 2.4M chips and more at 150k than
    a model whose recoveries start over, with the three 1.2M-chip figures held."""
    constants = GoodputConstants()
    for name, strategy, small, large in (
        ("plain", Strategy("plain"), (0.65, 0.75), (0.12, 0.2)),
        ("elastic", Strategy("elastic"), (0.85, 0.93), (0.36, 0.45)),
    ):
        assert closed_form_goodput(1_200_000, strategy, constants) == pytest.approx(SOURCE_GOODPUT[name], abs=0.005)
        assert small[0] < closed_form_goodput(150_000, strategy, constants) < small[1], name
        assert large[0] < closed_form_goodput(2_400_000, strategy, constants) < large[1], name
    assert closed_form_goodput(1_200_000, Strategy("diloco", 8), constants) == pytest.approx(0.88, abs=0.005)


def test_the_same_seed_gives_the_same_table_and_another_seed_another():
    constants = GoodputConstants(horizon_days=0.5, replicas=1)
    first, again, other = (simulate_grid(constants, seed, chips=[150_000], learners=[2]) for seed in (3, 3, 4))
    assert first.cells == again.cells and first.cells != other.cells


def test_the_command_writes_json_with_every_constant_it_used(tmp_path):
    path = tmp_path / "goodput.json"
    result = runner.invoke(
        app, ["simulate", "goodput", *SMALL, "--set", "mtbi_chip_hours=4380", "--seed", "5", "--output", str(path)]
    )
    assert result.exit_code == 0, result.output
    assert "mtbi_chip_hours" in result.output and "4380" in result.output and "DiLoCo M=2" in result.output
    document = json.loads(path.read_text())
    assert document["constants"]["mtbi_chip_hours"] == 4380 and document["constants"]["horizon_days"] == 0.5
    assert set(document["constants"]) == set(GoodputConstants.model_fields)
    assert document["seed"] == 5 and document["strategies"] == ["plain", "elastic", "diloco M=2"]
    assert {cell["strategy"] for cell in document["cells"]} == set(document["strategies"])
    printed = json.loads(
        runner.invoke(
            app, ["simulate", "goodput", *SMALL, "--set", "mtbi_chip_hours=4380", "--seed", "5", "-o", "json"]
        ).output
    )
    assert printed == document


def test_mistakes_are_one_line_errors_that_say_what_is_allowed():
    bad = runner.invoke(app, ["simulate", "goodput", "--set", "mtbi=1"])
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1
    assert "unknown key 'mtbi'" in bad.output and "mtbi_chip_hours" in bad.output and "restart_seconds" in bad.output
    for arguments, message in (
        (["--chips", "lots"], "'lots' is not a chip count"),
        (["--chips", "100", "--learners", "4"], "too few for 4 learners"),
        (["--output", "table.csv"], "expected text, json or a file name ending in .json"),
        (["--plot", "goodput.pdf"], "expected a file name ending in .png or .svg"),
    ):
        result = runner.invoke(app, ["simulate", "goodput", *arguments])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1 and message in result.output, (
            arguments
        )


def test_the_plot_is_drawn_or_says_how_to_get_matplotlib(tmp_path, monkeypatch):
    path = tmp_path / "goodput.svg"
    result = runner.invoke(app, ["simulate", "goodput", *SMALL, "--plot", str(path)])
    assert result.exit_code == 0 and path.read_text().lstrip().startswith("<?xml")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == "matplotlib" else real(name, *rest)
    )
    missing = runner.invoke(app, ["simulate", "goodput", *SMALL, "--plot", str(tmp_path / "other.png")])
    assert missing.exit_code == 2 and "pip install 'diloco-cli[plots]'" in missing.output
