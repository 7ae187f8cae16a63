"""Building a region's aggregates, and the error feedback of their quantization.

An aggregate of fragment p holds the sends the forwarding decided on (:mod:`diloco_cli.core.forwarding`),
each verified against its marker, anchored on its base with the region's copy of the
global weights (the drift since the base, from the window of the last W updates:
:func:`~diloco_cli.runtime.outer_gradients.accumulate_arrivals`) and folded into a
partial merge.  Sends whose base is older than the window are not merged: the aggregate
names them, and the syncer tells their learners to resync.  A send from a base newer than
the replica (the reducer is behind: restarted, or waiting on a repaired update) is never
built: it waits at the reducer until the replica has its base.

The partial merge is quantized with the run's codec (:mod:`diloco_cli.codec.aggregate`)
with error feedback: the quantization error of an aggregate is added to the next one of
the same fragment, as learners do with their deltas.  The error after each aggregate is
kept in the region's bucket (``reducer/residuals/``) beside the aggregate, so that a
restarted reducer goes on with it; when an aggregate is discarded unmerged (its
fragment moved on before the syncer took it), the error goes back to what it was before
it, because what that aggregate carried never arrived.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from diloco_cli.codec import CodecSpec, PayloadError, decode_payload, encode_payload
from diloco_cli.codec.aggregate import encode_aggregate, residual_names
from diloco_cli.core.fragments import Fragment
from diloco_cli.core.merge import MergeAccumulator
from diloco_cli.core.types import FragmentIndex
from diloco_cli.runtime.outer_gradients import RoundInput, accumulate_arrivals, check_announced
from diloco_cli.runtime.reducer.replica import GlobalReplica
from diloco_cli.runtime.workspace import MergeWorkspace
from diloco_cli.store import aggregates as store
from diloco_cli.store.aggregates import SendRecord
from diloco_cli.store.region import SEQUENCE_PER_EPOCH, PayloadRecord, RegionBucket

log = logging.getLogger("diloco.reducer")

RESIDUAL_SPEC = CodecSpec(codec="fp32", zstd_level=1)


def send_of(record: PayloadRecord) -> SendRecord:
    return SendRecord(record.key, record.learner, record.sequence, record.base_version, record.c_steps, record.c_tokens)


@dataclass(frozen=True)
class Built:
    """An aggregate written to the region's bucket."""

    key: str | None
    """None when nothing was written (every send refused)."""
    serial: int
    merged: tuple[SendRecord, ...]
    resync: tuple[SendRecord, ...]
    refused: tuple[tuple[SendRecord, PayloadError], ...]


class Aggregation:
    """One region's aggregates: their serial numbers and their error feedback."""

    def __init__(
        self,
        bucket: RegionBucket,
        fragments: tuple[Fragment, ...],
        codec: CodecSpec,
        epoch: int,
        workspace: MergeWorkspace | None = None,
        owned: tuple[Fragment, ...] | None = None,
    ) -> None:
        self.bucket, self.secret, self.fragments, self.codec = bucket, bucket.secret, fragments, codec
        """The region's bucket, and the run's secret its objects are sealed with (the bucket's)."""
        self.epoch = epoch
        self.workspace = workspace or MergeWorkspace()
        """The threads of the merges (``sync.merge_threads``) and the buffers they reuse."""
        self.made = 0
        self.errors: dict[FragmentIndex, dict[int, dict[str, torch.Tensor]]] = {
            f.index: {} for f in (fragments if owned is None else owned)
        }
        """Per fragment it aggregates (``owned``: a syncer shard's; every one by default),
        the quantization error after each aggregate still needed: the newest resolved one
        (where the chain starts) and every one in flight."""

    def _names(self, fragment: FragmentIndex) -> list[str]:
        spec = self.fragments[fragment]
        return residual_names(spec.parameter_names, spec.mean_names)

    def _zeros(self, fragment: FragmentIndex, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        spec = self.fragments[fragment]
        names = dict(zip(self._names(fragment), spec.parameter_names))
        return {name: torch.zeros(shapes[parameter]) for name, parameter in names.items()}

    def current_error(self, fragment: FragmentIndex, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        errors = self.errors[fragment]
        return errors[max(errors)] if errors else self._zeros(fragment, shapes)

    # ------------------------------------------------------------------- restoring

    def restore(self, in_flight: Mapping[FragmentIndex, list[int]], merged_marks: Mapping[FragmentIndex, int]) -> None:
        """The error chain of each fragment from the region's bucket: the newest error at
        or below the fragment's merged mark (the syncer merged up to that serial), then
        the errors of the aggregates still in flight; the rest (an aggregate discarded,
        or one never written because the reducer was killed) is dropped."""
        for fragment, serials in store.residual_serials(self.bucket).items():
            if fragment not in self.errors:
                continue
            mark = merged_marks.get(fragment, -1)
            resolved = [s for s in serials if s <= mark]
            keep = ([max(resolved)] if resolved else []) + [
                s for s in serials if s > mark and s in in_flight.get(fragment, [])
            ]
            for serial in serials:
                if serial not in keep:
                    store.delete_residual(self.bucket, fragment, serial)
                    continue
                try:
                    decoded = decode_payload(store.read_residual(self.bucket, fragment, serial), self.secret)
                except (PayloadError, FileNotFoundError) as error:
                    log.warning(
                        "the error feedback after aggregate %d of fragment %d is lost: %s", serial, fragment, error
                    )
                    continue
                self.errors[fragment][serial] = dict(decoded.tensors)

    # -------------------------------------------------------------------- building

    def build(
        self,
        fragment: FragmentIndex,
        records: list[PayloadRecord],
        replica: GlobalReplica,
        refused: Callable[[str, str, Exception], None],
    ) -> Built:
        """Verify, anchor and merge ``records`` into an aggregate of ``fragment`` and
        write it (unless every one of them is refused)."""
        window = replica.windows[fragment]
        theta = replica.fragment_theta(fragment)
        shapes = {name: tuple(tensor.shape) for name, tensor in theta.items()}
        if newer := [record.key for record in records if record.base_version > window.newest]:
            raise ValueError(f"sends from bases the replica has not reached yet must wait: {newer}")
        anchorable = [record for record in records if window.can_anchor(record.base_version)]
        resync = tuple(send_of(record) for record in records if not window.can_anchor(record.base_version))
        by_input: dict[int, PayloadRecord] = {}
        inputs = []
        for record in anchorable:
            arrival = RoundInput(
                record.learner, record.base_version, record.c_steps, record.c_tokens, self._loader(record)
            )
            inputs.append(arrival)
            by_input[id(arrival)] = record
        accumulator = MergeAccumulator(shapes, self.fragments[fragment].mean_names, self.workspace)
        accumulated = accumulate_arrivals(fragment, inputs, shapes, window, self.secret, accumulator, self.workspace)
        problems = []
        for arrival, error in accumulated.rejected:
            record = by_input[id(arrival)]
            refused("payload", record.key, error)
            problems.append((send_of(record), error))
        merged = tuple(send_of(by_input[id(arrival)]) for arrival in accumulated.merged)
        if not merged and not resync:
            return Built(None, 0, (), (), tuple(problems))
        self.made += 1
        serial = self.epoch * SEQUENCE_PER_EPOCH + self.made
        error = {name: tensor.clone() for name, tensor in self.current_error(fragment, shapes).items()}
        meta = {
            "fragment": fragment,
            "serial": serial,
            "anchor": replica.versions[fragment],
            "region": self.bucket.name,
        }
        payload = encode_aggregate(accumulator.partial(), self.codec, self.secret, meta, residuals=error)
        store.write_residual(self.bucket, fragment, serial, encode_payload(error.items(), RESIDUAL_SPEC, self.secret))
        key = store.write_aggregate(
            self.bucket, fragment, serial, replica.versions[fragment], list(merged), list(resync), payload
        )
        self.errors[fragment][serial] = error
        return Built(key, serial, merged, resync, tuple(problems))

    def _loader(self, record: PayloadRecord) -> Callable[[], bytes]:
        def load() -> bytes:
            try:
                blob = self.bucket.read_payload(record.key)
            except FileNotFoundError:
                blob = None
            check_announced(record, blob, self.secret)
            return blob

        return load

    # ------------------------------------------------------------------- resolving

    def resolved(self, fragment: FragmentIndex, serial: int, merged: bool) -> None:
        """The syncer merged aggregate ``serial`` (its error is where the chain goes on
        from), or discarded it (its error, and those after it, are dropped)."""
        errors = self.errors[fragment]
        drop = [s for s in errors if (s < serial if merged else s >= serial)]
        for s in drop:
            del errors[s]
            store.delete_residual(self.bucket, fragment, s)
