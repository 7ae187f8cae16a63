"""List prices: the shipped table, a user's overrides, bad files, and what bytes and
requests cost by provider (figures by hand)."""

import pytest

from diloco_cli.bandwidth.prices import GB, egress_dollars, load_prices, provider_of, request_dollars
from diloco_cli.config.errors import ConfigError


def test_default_prices_load():
    prices = load_prices()
    aws, gcp, azure = prices.providers.aws, prices.providers.gcp, prices.providers.azure
    assert (aws.egress_inter_region_per_gb, aws.egress_internet_per_gb, aws.put_per_1000, aws.get_per_1000) == (
        0.02,
        0.09,
        0.005,
        0.0004,
    )
    assert (gcp.egress_inter_region_per_gb, gcp.egress_internet_per_gb, gcp.put_per_1000, gcp.get_per_1000) == (
        0.02,
        0.12,
        0.005,
        0.0004,
    )
    assert (azure.egress_inter_region_per_gb, azure.egress_internet_per_gb, azure.put_per_1000, azure.get_per_1000) == (
        0.02,
        0.087,
        0.0065,
        0.0005,
    )
    assert prices.looked_up.year >= 2024 and "remembered" in prices.note


def test_a_user_file_overrides_one_price(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("providers:\n  aws:\n    egress_internet_per_gb: 0.05\n")
    prices = load_prices(path)
    assert prices.providers.aws.egress_internet_per_gb == 0.05
    assert (
        prices.providers.aws.egress_inter_region_per_gb == 0.02 and prices.providers.gcp.egress_internet_per_gb == 0.12
    )


def test_a_bad_price_file_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("providers:\n  aws:\n    egress_internet_per_gb: -1\n")
    with pytest.raises(ConfigError, match=rf"{path}: providers\.aws\.egress_internet_per_gb"):
        load_prices(path)
    path.write_text("providers:\n  gcp:\n    egres_internet_per_gb: 0.1\n")
    with pytest.raises(
        ConfigError,
        match=rf"{path}: unknown key 'providers\.gcp\.egres_internet_per_gb'.*did you mean 'egress_internet_per_gb'",
    ):
        load_prices(path)
    path.write_text("providers: [")
    with pytest.raises(ConfigError, match=f"{path}: not valid YAML"):
        load_prices(path)


def test_providers_and_what_bytes_and_requests_cost():
    assert [
        provider_of(u)
        for u in (
            "s3://b/r",
            "gs://b",
            "gcs://b",
            "az://c",
            "abfs://c",
            "abfss://c",
            "file:///tmp/x",
            "memory://x",
            "/tmp",
        )
    ] == [
        "aws",
        "gcp",
        "gcp",
        "azure",
        "azure",
        "azure",
        None,
        None,
        None,
    ]
    prices = load_prices()
    assert egress_dollars(prices, 10 * GB, "aws", "aws") == pytest.approx(0.2)  # another AWS region
    assert egress_dollars(prices, 10 * GB, "aws", "gcp") == pytest.approx(0.9)  # the internet
    assert egress_dollars(prices, 10 * GB, "aws", None) == pytest.approx(0.9)  # a machine elsewhere
    assert egress_dollars(prices, 10 * GB, "aws", "aws", same_region=True) == 0.0
    assert egress_dollars(prices, 10 * GB, None, "aws") == 0.0  # not a cloud: free
    assert request_dollars(prices, "azure", put_like=2000, get_like=10_000) == pytest.approx(2 * 0.0065 + 10 * 0.0005)
    assert request_dollars(prices, None, 1e6, 1e6) == 0.0
