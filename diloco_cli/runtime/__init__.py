"""The runtimes: the learner and the syncer, built from the core and the codec.

They reach storage only through the store layer's functions passed in or imported at
their edges, so a merge round can also run over payloads held in memory or on disk.
"""
