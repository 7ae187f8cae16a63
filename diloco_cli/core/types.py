"""Identifiers that must not be mixed up with one another or with plain numbers."""

from typing import NewType

LearnerId = NewType("LearnerId", str)
"""A learner's stable name within a run, e.g. ``"eu-0"``."""

RegionName = NewType("RegionName", str)
"""A region's name as written in the region file, e.g. ``"us-east"``."""

FragmentIndex = NewType("FragmentIndex", int)
"""The index of a fragment of the model's parameters, 0 <= p < P."""

Version = NewType("Version", int)
"""A global version: the number of outer steps the syncer has published (0 = initial)."""
