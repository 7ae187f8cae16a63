"""Data: what learners train on and the syncer evaluates on, from a corpus to a batch.

- :mod:`~diloco_cli.data.corpora`: the corpora that ship with the package
  (``builtin:shakespeare``, in ``shakespeare.txt.zst``, described in README.md here),
  checked by hash, and :class:`~diloco_cli.data.corpora.DataError`; no torch, so
  ``diloco up`` checks a recipe's source at once.
- :mod:`~diloco_cli.data.text`: byte-level text: loading a source, the held-out split,
  each learner's disjoint shard, random training windows and fixed evaluation batches.
- :mod:`~diloco_cli.data.tokens`: token datasets, made by ``diloco prepare`` (corpus,
  tokenizer, shards, index, upload, existing nanoGPT-style shards) and streamed by
  ranged reads (ranges, chunks, stream); see its own docstring.
- :mod:`~diloco_cli.data.learner`: what a learner reads (its batches from text or tokens,
  and its data position for checkpoints) and the syncer's held-out batches.

Above configuration, the store, models and training, below the runtimes and the
traffic model: training never imports data (a learner hands it batches).
"""
