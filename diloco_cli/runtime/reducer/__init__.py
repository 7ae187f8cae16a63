"""A region's reducer: its learners' sends merged in-region, one aggregate per fragment
forwarded across the WAN, the region's copy of the global weights and its snapshots.

* :mod:`.loop`: :class:`~.loop.Reducer`, its turn (follow, resolve, look, forward, report)
  around its pure decisions, :mod:`diloco_cli.core.reducer_step` (when to forward, and
  which sends: :mod:`diloco_cli.core.forwarding`), on the shared skeleton
  :mod:`diloco_cli.runtime.coordinator`.
* :mod:`.region_objects`: its payloads, relays and aggregates in the region's bucket: the
  observations read there, the actions carried out there.
* :mod:`.region_copy`: the region's copy of the global weights kept up with the head,
  and the region's snapshots.
* :mod:`.replica`: that copy, exact (version 0 from the seed, updates added in order).
* :mod:`.aggregation`: building an aggregate, and its error feedback.
"""
