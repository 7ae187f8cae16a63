"""The syncer: one CPU process that merges the learners' progress and publishes it.

* :mod:`.loop`: :class:`~.loop.Syncer`, its turn (observe, decide, act, upkeep): the
  place to read what the syncer does and when.  Whether to merge is decided by the pure
  state machine :mod:`diloco_cli.core.decisions`.
* :mod:`.build` and :mod:`.context`: the syncer's collaborators built in one function
  from the run spec, around what they share (recipe, shard, secret, stores, clock).
* :mod:`.observation` and :mod:`.region_scan`: what each region's bucket shows
  (payloads, heartbeats), :mod:`.reachability`: regions that cannot be reached now.
* :mod:`.merging` and :mod:`.merge_round`: carrying out a merge (read, verify, merge,
  commit, publish) and its mathematics on tensors.
* :mod:`.state`: the global weights, outer optimizer and ledger, committed and restored.
* :mod:`.publication`: the global objects in every region's bucket, kept whole.
* :mod:`.evaluation`, :mod:`.status`, :mod:`.leftovers`: held-out loss, the status
  document, and removing what killed writes leave.
* :mod:`.following` and :mod:`.ending`: taking in ``diloco scale`` and ``diloco chaos``,
  and when the run is over.
* :mod:`.fanout`: calls to every region at once.
"""
