"""A region's partial merge as one authenticated payload: what its reducer forwards.

A :class:`~diloco_cli.core.merge.PartialMerge` over W total weight holds, per RDA tensor,
``sum w unit(D)`` and ``sum w |D|``, and per mean tensor ``sum w D``.  Its payload holds
them divided by W: the mean unit direction (norm at most 1) and the weighted mean of
each mean tensor, quantized with the run's codec, and in its metadata W, the number of
sends and each tensor's mean norm (float64, exact).  Dividing by W keeps the values at
one scale whatever the weights, so that the reducer's error feedback (the quantization
error of one aggregate, carried into the next of the same fragment, as learners carry
theirs) adds values of the same scale.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from diloco_cli.codec.errors import CorruptPayload
from diloco_cli.codec.frame import decode_payload, encode_payload
from diloco_cli.codec.secret import RunSecret
from diloco_cli.codec.spec import CodecSpec
from diloco_cli.core.merge import PartialMerge

UNIT, MEAN = "unit/", "mean/"


def residual_names(names: Collection[str], mean_names: Collection[str]) -> list[str]:
    """The tensor names of an aggregate (and of its error-feedback residual)."""
    return [(MEAN if name in mean_names else UNIT) + name for name in names]


def encode_aggregate(
    part: PartialMerge,
    spec: CodecSpec,
    secret: RunSecret,
    meta: Mapping[str, Any],
    residuals: Mapping[str, torch.Tensor] | None = None,
) -> bytes:
    """The payload of ``part``: its sums divided by its total weight, plus ``residuals``
    (named as :func:`residual_names`), whose tensors then receive the new quantization
    error (error feedback).  ``part``'s tensors are left as they were."""
    weight = part.total_weight
    scale = 1.0 / weight if weight > 0 else 0.0

    def normalized():
        for prefix, sums in ((UNIT, part.unit_sums), (MEAN, part.mean_sums)):
            for name, total in sums.items():
                value = total.mul(scale)
                if residuals is not None:
                    value.add_(residuals[prefix + name])
                yield prefix + name, value

    full_meta = {
        **meta,
        "total_weight": weight,
        "count": part.count,
        "mean_norms": {name: norm * scale for name, norm in part.norm_sums.items()},
    }
    return encode_payload(normalized(), spec, secret, full_meta, residuals_into=residuals)


def decode_aggregate(payload: bytes, secret: RunSecret) -> tuple[PartialMerge, dict[str, Any]]:
    """Verify and decode an aggregate back into the sums it stands for, and its metadata."""
    decoded = decode_payload(payload, secret)
    meta = decoded.meta
    try:
        weight = float(meta["total_weight"])
        count = int(meta["count"])
        mean_norms = {str(name): float(norm) for name, norm in meta["mean_norms"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CorruptPayload(f"an aggregate's metadata lacks its weights: {error}") from None
    unit_sums = {name[len(UNIT) :]: t.mul_(weight) for name, t in decoded.tensors.items() if name.startswith(UNIT)}
    mean_sums = {name[len(MEAN) :]: t.mul_(weight) for name, t in decoded.tensors.items() if name.startswith(MEAN)}
    if set(mean_norms) != set(unit_sums) or len(unit_sums) + len(mean_sums) != len(decoded.tensors):
        raise CorruptPayload("an aggregate's tensors and its norms do not match")
    norm_sums = {name: norm * weight for name, norm in mean_norms.items()}
    return PartialMerge(weight, count, unit_sums, norm_sums, mean_sums), meta
