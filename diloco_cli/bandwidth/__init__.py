"""What a run asks of the network, before it starts: traffic per link, compute share,
time to a token budget, cost, and synchronous data-parallel training beside it.

:mod:`~diloco_cli.bandwidth.model` holds the formulas (pure, no I/O; synchronous
data-parallel's ring all-reduce in :mod:`~diloco_cli.bandwidth.ring`), with the flows on
each link in :mod:`~diloco_cli.bandwidth.flows`, its inputs and results in
:mod:`~diloco_cli.bandwidth.shapes` and the sizes of the JSON documents in
:mod:`~diloco_cli.bandwidth.document_sizes`;
:mod:`~diloco_cli.bandwidth.traffic_plan` builds a plan from what
:mod:`~diloco_cli.bandwidth.measure` measures (an inner step, the codecs' real sizes)
and :mod:`~diloco_cli.bandwidth.prices` prices bytes and requests.  The traffic model
is spelled out in docs/bandwidth.md.
"""
