"""Token datasets: made by ``diloco prepare``, streamed to learners by ranged reads.

A dataset is a directory (local or in a bucket) of flat binary token shards, the
tokenizer that made them and a small JSON index (:mod:`~diloco_cli.data.tokens.index`),
written last so that a half-made dataset is never trusted.
:mod:`~diloco_cli.data.tokens.prepare` makes one from a corpus (text, JSONL or Parquet;
:mod:`~diloco_cli.data.tokens.corpus`) through :mod:`~diloco_cli.data.tokens.shards` and
:mod:`~diloco_cli.data.tokens.upload`, or indexes nanoGPT-style shards that already exist
(:mod:`~diloco_cli.data.tokens.existing`).  A learner reads only its own token range
(:mod:`~diloco_cli.data.tokens.ranges`) through :class:`~diloco_cli.data.tokens.stream.TokenBatches`,
chunk by chunk with read-ahead and a bounded cache (:mod:`~diloco_cli.data.tokens.chunks`).
The layout and the commands are described in docs/data.md.
"""
