"""A realistic traffic report (two regions of two learners and a syncer outside both), and
the ids of the tables and plots its HTML page must show."""

from diloco_cli.bandwidth.report import (
    Compression,
    DataParallelComparison,
    KindRow,
    LearnerTraffic,
    LinkRow,
    SyncerTraffic,
    TrafficReport,
)
from diloco_cli.store.documents import Evaluation

TABLES = ("table-links", "table-learners", "table-kinds", "table-compression", "table-data-parallel")


PLOTS = ("plot-bytes", "plot-rates", "plot-loss-tokens", "plot-loss-time")


START = 1_790_000_000.0


NASTY = '<script>alert("x")</script> & <b>'


def history(rate_up: int, rate_down: int, samples: int = 12) -> list[tuple[float, int, int]]:
    return [(START + 30 * i, rate_up * i, rate_down * i) for i in range(samples)]


def link(source: str, bucket: str, up: int, down: int, share: float, cost: float) -> LinkRow:
    return LinkRow(
        source=source,
        bucket=bucket,
        wan=source != bucket,
        requests=420,
        bytes_up=up,
        bytes_down=down,
        seconds=12.5,
        megabytes_per_second=(up + down) / 12.5 / 1e6,
        share=share,
        cost_dollars=cost,
        history=history(up // 11, down // 11),
        kinds={"payload": up // 2, "update": down // 2, "heartbeat": up - up // 2, "listing": down - down // 2},
    )


def learner(name: str, region: str) -> LearnerTraffic:
    return LearnerTraffic(
        learner=name,
        region=region,
        tokens=1_200_000,
        delta_bytes_up=48_000_000,
        checkpoint_bytes_up=9_000_000,
        other_bytes_up=120_000,
        bytes_down=51_000_000,
        requests=310,
        retries=2,
        failures=0,
    )


def realistic(**changes) -> TrafficReport:
    """Two regions with two learners each, and a syncer outside both."""
    links = [
        link("eu-west", "eu-west", 114_000_000, 102_000_000, 0.3, 0.01),
        link("us-east", "us-east", 114_000_000, 102_000_000, 0.3, 0.01),
        link("syncer-host", "eu-west", 60_000_000, 70_000_000, 0.2, 6.3),
        link("syncer-host", "us-east", 60_000_000, 70_000_000, 0.2, 6.3),
    ]
    wan = 260_000_000
    fields = dict(
        run="demo-run",
        state="training",
        elapsed_seconds=330.0,
        tokens=4_800_000,
        learners_reporting=4,
        links=links,
        learners=[learner(f"l{i}", region) for i, region in enumerate(("eu-west", "eu-west", "us-east", "us-east"))],
        syncers=[
            SyncerTraffic(
                name="syncer",
                place="syncer-host",
                merges=80,
                requests=4_000,
                bytes_up=120_000_000,
                bytes_down=140_000_000,
                home_bytes=90_000_000,
            )
        ],
        kinds=[
            KindRow(kind="payload", requests=160, bytes_up=192_000_000, bytes_down=120_000_000, wan_bytes=120_000_000),
            KindRow(kind="update", requests=80, bytes_up=120_000_000, bytes_down=204_000_000, wan_bytes=120_000_000),
            KindRow(kind="heartbeat", requests=900, bytes_up=1_400_000, bytes_down=0, wan_bytes=0),
        ],
        compression=[
            Compression(kind="payload", bytes=192_000_000, raw_fp32_bytes=1_536_000_000),
            Compression(kind="update", bytes=120_000_000, raw_fp32_bytes=960_000_000),
        ],
        data_parallel=DataParallelComparison(
            parameters=124_000_000,
            workers=4,
            tokens_per_step=32_768,
            steps=146.5,
            bytes_per_worker_step=372_000_000,
            total_bytes=146.5 * 4 * 372_000_000,
            region_crossings=2,
            wan_bytes=146.5 * 2 * 372_000_000,
            regions=2,
            hierarchical_wan_bytes=146.5 * 2 * 248_000_000,
            diloco_wan_bytes=wan,
        ),
        evaluations=[
            Evaluation(version=v, loss=4.2 - 0.3 * v, tokens=600_000 * v, time=START + 40 * v) for v in range(1, 8)
        ],
        started_at=START,
        prices_looked_up="2025-06",
        cost_note=f"list prices looked up 2025-06 {NASTY}",
        total_bytes=866_000_000,
        wan_bytes=wan,
    )
    return TrafficReport(**{**fields, **changes})
