"""Numbers on the command line: finite, and within what the option means.

Whole numbers are bounded by ``parameters.Whole``; these parsers are for real
numbers, which Python happily reads as ``nan`` or ``inf`` (``--timeout nan``,
``--link-mbit inf``) where no option means either.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

MAX_SEED = 2**64 - 1
"""The largest seed torch's generators take."""
MAX_SAMPLE_TOKENS = 100_000
"""``diloco sample -n``: a long story, generated one token at a time (minutes on a CPU)."""


def shown(number: float) -> str:
    """``10,000,000``, ``0.5``: a bound as people write it."""
    return f"{int(number):,}" if number == int(number) else f"{number:g}"


def bounds_text(minimum: float | None, above: float | None, maximum: float | None) -> str:
    """``>= 0``, ``> 0``, ``in (0, 1]``: what a number must be, for messages."""
    low = f"({shown(above)}" if above is not None else f"[{shown(minimum)}" if minimum is not None else None
    if low is not None and maximum is not None:
        return f"in {low}, {shown(maximum)}]"
    if above is not None:
        return f"> {shown(above)}"
    if minimum is not None:
        return f">= {shown(minimum)}"
    return f"<= {shown(maximum)}" if maximum is not None else ""


def finite(
    *, minimum: float | None = None, above: float | None = None, maximum: float | None = None
) -> Callable[[Any], float]:
    """A parser (``parameters.Real(...)``) of a finite real number at least ``minimum``
    (or greater than ``above``) and at most ``maximum``."""
    wanted = " ".join(("a finite number", bounds_text(minimum, above, maximum))).strip()

    def parse(value: Any) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{value!r} is not a number; expected {wanted}") from None
        if (
            not math.isfinite(number)
            or (minimum is not None and number < minimum)
            or (above is not None and number <= above)
            or (maximum is not None and number > maximum)
        ):
            raise ValueError(f"{value!r}: expected {wanted}")
        return number

    return parse
