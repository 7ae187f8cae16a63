"""Numbers for people: bytes, counts, durations."""

from __future__ import annotations


def human_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def human_count(count: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.1f}{unit}"
    return f"{count:.0f}"


def human_duration(seconds: float | None, compact: bool = False) -> str:
    """``7 s``, ``3 min 05 s``, ``2 h 03 min``; with ``compact`` ``7s``, ``3m05s``,
    ``2h03m`` for narrow table cells."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    second, minute, hour = ("s", "m", "h") if compact else (" s", " min", " h")
    gap = "" if compact else " "
    if seconds < 60:
        return f"{seconds:.0f}{second}"
    if seconds < 3600:
        return f"{seconds // 60:.0f}{minute}{gap}{seconds % 60:02.0f}{second}"
    return f"{seconds // 3600:.0f}{hour}{gap}{seconds % 3600 // 60:02.0f}{minute}"


def ago(seconds: float | None) -> str:
    return "never" if seconds is None else f"{human_duration(seconds)} ago"


def plural(count: int, word: str) -> str:
    """``1 learner``, ``2 learners``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"
