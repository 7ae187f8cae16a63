"""The stand-ins for clouds, WANs and servers that tests and benchmarks start.

S3 and GCS servers (:mod:`testbed.servers`), network namespaces with shaped links
(:mod:`testbed.netns`), an emulated WAN of regions joined by a router (:mod:`testbed.wan`),
and the proxies in front of a bucket: one that delays and counts bytes
(:mod:`testbed.delay_proxy`) and one that injects faults (:mod:`testbed.fault_proxy`).

Both ``tests/`` and ``bench/`` import it, and neither reaches into the other; the product
(``diloco_cli``) never imports it, and the wheel does not ship it.
"""
