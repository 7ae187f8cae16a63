"""The store protocol over fsspec: how a run lives in each region's bucket and in the
syncer's home store (see docs/protocol.md)."""
