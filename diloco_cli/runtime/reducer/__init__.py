"""A region's reducer: its learners' sends merged in-region, one aggregate per fragment
forwarded across the WAN, the region's copy of the global weights and its snapshots.

* :mod:`.loop`: :class:`~.loop.Reducer`, its turn (follow, resolve, look, forward, report):
  the I/O around its pure decisions, :mod:`diloco_cli.core.reducer_step`.
* :mod:`.replica`: the region's exact copy of the global weights (version 0 from the seed).
* :mod:`diloco_cli.core.forwarding`: when to forward, and which sends (pure, clock injected).
* :mod:`.aggregation`: building an aggregate, and its error feedback.
"""
