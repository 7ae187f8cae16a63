"""What bytes and requests cost: a typed price table per provider, and the rules that apply it.

The defaults ship as ``prices.yaml`` beside this module (list prices as remembered when
it was written; the file says so and when).  A YAML file of your own overrides any of
them: only the keys it sets change.  Egress is billed by the provider of the place the
bytes leave: a bucket read from another region of the same provider pays the
inter-region rate, one read from anywhere else the internet rate, and a bucket that is
not in a cloud (``file://``, ``memory://``) costs nothing.  Requests are billed by the
bucket's provider: PUT/POST/LIST at one price, GET/HEAD at another, DELETE free.
"""

from __future__ import annotations

import datetime
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco_cli.config.errors import ConfigError
from diloco_cli.config.loading import deep_merged, describe_validation_error, read_yaml

FROZEN = ConfigDict(frozen=True, extra="forbid")

GB = 2**30
"""The unit providers bill transfer in (their pages say GB; their bills count 2^30 bytes)."""

PROVIDERS = {
    "s3": "aws",
    "s3a": "aws",
    "gs": "gcp",
    "gcs": "gcp",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
}
"""URL schemes of the cloud object stores, and whose they are."""


class ProviderPrices(BaseModel):
    """One provider's prices for its object storage."""

    model_config = FROZEN

    egress_inter_region_per_gb: float = Field(ge=0)
    """$ per GB leaving a bucket for another region of the same provider."""
    egress_internet_per_gb: float = Field(ge=0)
    """$ per GB leaving a bucket for the internet (another provider, a machine elsewhere)."""
    put_per_1000: float = Field(ge=0)
    """$ per 1,000 PUT, COPY, POST or LIST requests (GCS class A, Azure write and list)."""
    get_per_1000: float = Field(ge=0)
    """$ per 1,000 GET or HEAD requests (GCS class B, Azure read)."""
    source: str = ""
    """Where to check them."""


class Providers(BaseModel):
    model_config = FROZEN

    aws: ProviderPrices
    gcp: ProviderPrices
    azure: ProviderPrices


class PriceTable(BaseModel):
    """Prices per provider, with when and how they were found."""

    model_config = FROZEN

    looked_up: datetime.date
    """When the prices were written down."""
    note: str
    """How they were found (and how far to trust them)."""
    providers: Providers

    def of(self, provider: str) -> ProviderPrices:
        return getattr(self.providers, provider)


def _defaults() -> dict[str, Any]:
    with resources.as_file(resources.files("diloco_cli.bandwidth") / "prices.yaml") as path:
        return read_yaml(Path(path))


def load_prices(path: Path | str | None = None) -> PriceTable:
    """The packaged price table, with the values of the YAML file at ``path`` (if given)
    in place of the defaults.  A wrong file raises ConfigError naming the file and key."""
    data = _defaults()
    source = "the packaged prices.yaml"
    if path is not None:
        path = Path(path)
        data = deep_merged(data, read_yaml(path))
        source = str(path)
    try:
        return PriceTable.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, PriceTable, source)) from None


def provider_of(url: str | None) -> str | None:
    """``aws``, ``gcp`` or ``azure`` for a bucket URL of theirs; None for anything else
    (``file://``, ``memory://``, a path: local, and free)."""
    if not url or "://" not in url:
        return None
    return PROVIDERS.get(url.split("://", 1)[0].lower())


def egress_dollars(
    prices: PriceTable, num_bytes: float, source: str | None, reader: str | None, same_region: bool = False
) -> float:
    """What ``num_bytes`` leaving a place of provider ``source`` for a reader of provider
    ``reader`` cost: nothing when the source is not a cloud or the reader is in the same
    region; the inter-region rate when the reader is in another region of the same
    provider; the internet rate otherwise."""
    if source is None or same_region:
        return 0.0
    table = prices.of(source)
    rate = table.egress_inter_region_per_gb if reader == source else table.egress_internet_per_gb
    return num_bytes / GB * rate


def request_dollars(prices: PriceTable, provider: str | None, put_like: float, get_like: float) -> float:
    """What ``put_like`` PUT/POST/LIST and ``get_like`` GET/HEAD requests to a bucket of
    ``provider`` cost (DELETE is free; a bucket that is not in a cloud costs nothing)."""
    if provider is None:
        return 0.0
    table = prices.of(provider)
    return put_like / 1000 * table.put_per_1000 + get_like / 1000 * table.get_per_1000
