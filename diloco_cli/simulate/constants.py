"""The constants of the goodput simulation, each with what it means and where it comes from.

Only the per-chip MTBI is the source's (arXiv 2604.21428: one year per chip).  The rest
cannot be known from the paper; ``docs/goodput.md`` says how each was chosen, and which
three were fitted so that the simulation reproduces the source's figures at 1.2M chips.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

HOUR = 3600.0
DAY = 24 * HOUR

DEFAULT_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
DEFAULT_LEARNERS = (1, 2, 4, 8, 16)

MAX_CHIPS = 100_000_000
"""The largest cluster simulated: its interruptions, one by one, take about a minute."""

CALIBRATION_CHIPS = 1_200_000
SOURCE_GOODPUT = {"plain": 0.27, "elastic": 0.58, "diloco M=8": 0.88}
"""What the source reports at 1.2M chips with a per-chip MTBI of one year (its goodput
figure); the fitted constants below reproduce it."""


class GoodputConstants(BaseModel):
    """Every constant of the simulated cluster and strategies (override with ``--set``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    mtbi_chip_hours: float = Field(default=8760.0, gt=0)
    """Mean time between interruptions of one chip, in hours (the source: one year).
    Interruptions are a Poisson process: a cluster of N chips is interrupted N times as
    often.  ``.inf`` turns failures off."""

    slice_chips: int = Field(default=64, ge=1)
    """Chips per slice, the unit that fails and is replaced: an interrupted chip takes its
    whole slice out (a TPU cube of 4x4x4 chips; eight 8-GPU hosts)."""

    repair_hours: float = Field(default=1.0, ge=0)
    """Hours until an interrupted slice is back in service (reboot, drain, swap)."""

    spare_fraction: float = Field(default=0.02, ge=0, lt=1)
    """Share of the N chips' slices held as hot spares by the strategies that restart
    (plain data-parallel, DiLoCo learners): a failed slice is swapped for a spare at once;
    with none left, the job waits for a repair.  Spares count in the total chip-time.
    Elastic data-parallel keeps none: it trains on every slice that is up."""

    restart_seconds: float = Field(default=37.5, ge=0)
    """Plain data-parallel: seconds to restart the whole job on a spare and reload the
    last checkpoint (from host memory).  A slice that fails during a restart is swapped
    within it.  Fitted: 27% goodput at 1.2M chips."""

    checkpoint_seconds: float = Field(default=2.0, ge=0)
    """Plain data-parallel: seconds the job stops to take one checkpoint (the blocking
    part of an asynchronous snapshot to host memory)."""

    checkpoint_interval_seconds: float | None = Field(default=None, gt=0)
    """Plain data-parallel: seconds of training between checkpoints; empty: Daly's
    optimum for the job's mean time between failures."""

    reconfigure_seconds: float = Field(default=9.5, ge=0)
    """Elastic data-parallel: seconds the whole job pauses to shrink around a failed slice
    or grow back onto a repaired one (no work is lost; changes that arrive during a pause
    are taken by it).  Fitted: 58% goodput at 1.2M chips."""

    learner_restart_seconds: float = Field(default=13.5, ge=0)
    """Decoupled DiLoCo: seconds for one learner (1/M of the chips) to restart on a spare
    and resync from the global weights.  A slice of it that fails meanwhile is swapped
    within it.  Fitted: 88% goodput at 1.2M chips with M=8."""

    send_interval_seconds: float = Field(default=20.0, gt=0)
    """Decoupled DiLoCo: seconds of training between two sends of a learner (H inner
    steps); what a learner did since its last send is lost when it fails."""

    horizon_days: float = Field(default=7.0, gt=0, le=3650)
    """Simulated wall time per replica, in days (at most ten years)."""

    replicas: int = Field(default=2, ge=1, le=1000)
    """Independent replicas per cell (seeded from ``--seed``); the table shows their mean."""

    @property
    def mtbi_chip_seconds(self) -> float:
        return self.mtbi_chip_hours * HOUR

    @property
    def repair_seconds(self) -> float:
        return self.repair_hours * HOUR

    @property
    def horizon_seconds(self) -> float:
        return self.horizon_days * DAY

    def slices(self, chips: int) -> int:
        """Slices of a cluster of ``chips`` chips (at least one)."""
        return max(1, round(chips / self.slice_chips))

    def spare_slices(self, chips: int) -> int:
        return round(self.spare_fraction * self.slices(chips))


def parse_chip_count(text: str) -> int:
    """``150000``, ``150k``, ``1.2M`` or ``2.4m`` as a number of chips."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 1e3, "m": 1e6}.get(cleaned[-1:].lower(), 1.0)
    number = cleaned[:-1] if scale != 1.0 else cleaned
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a chip count (e.g. 150000, 150k, 1.2M)") from None
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{text!r} is not a chip count (e.g. 150000, 150k, 1.2M)")
    if value > MAX_CHIPS:
        raise ValueError(f"{text!r}: at most {chip_label(MAX_CHIPS)} chips (the simulated time grows with the size)")
    return round(value)


def chip_label(chips: int) -> str:
    """``1.2M``, ``150k``: a chip count as the source writes it."""
    if chips >= 1_000_000:
        return f"{chips / 1e6:g}M"
    if chips >= 1_000:
        return f"{chips / 1e3:g}k"
    return str(chips)
