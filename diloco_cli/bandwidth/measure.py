"""What a plan measures on this machine: timed inner steps and real encoder sizes.

The formulas of :mod:`diloco_cli.bandwidth.model` take numbers that no formula gives:
they depend on the model, the codecs and the machine.  :mod:`diloco_cli.bandwidth.traffic_plan`
measures them here rather than estimating them, so that a plan predicts the traffic and
the compute share of the run it describes:

* the inner step's compute time (:func:`measure_step_seconds`): the recipe's model and
  batch through the learners' own inner step (AdamW, the recipe's loss, precision,
  micro-batches, backward and clipping), a few warm steps then a few timed ones on the
  recipe's device, each timed on its own so that the plan can say how much they varied;
* every payload's real size (:class:`Sizer`), by encoding seeded sample tensors of each
  fragment's shapes (:func:`model_fragments`, or :func:`even_fragments` for a bare
  parameter count) with the real encoder: frame, header, packed values, scales,
  zstandard.  A fragment of more than :data:`EXACT_VALUES` values is sized from its
  exact layout and the compression measured on a :data:`SAMPLE_VALUES` sample;
* the training thread's time to encode a fragment's delta, to add an update and check
  its digest, and to encode a checkpoint, timed on the same samples.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diloco_cli.codec import CodecSpec, RunSecret
from diloco_cli.config.errors import ConfigError
from diloco_cli.config.recipe import Recipe
from diloco_cli.store.region import MARKER_SPEC, SNAPSHOT_SPEC

if TYPE_CHECKING:
    import torch

EXACT_VALUES = 1 << 16
"""Fragments of up to this many values are encoded whole to size them."""

SAMPLE_VALUES = 1 << 16
"""Values of the sample that sizes and times a larger fragment (scaled by its size): the
compression of 64k values is that of the whole fragment within about 0.3% (842k-value
fragments of the default model), and a plan given its step time answers in well under a
second instead of encoding every fragment whole with every codec."""

WARM_STEPS = 2
TIMED_STEPS = 5
NOISY_SPREAD = 0.25
"""Timed steps whose fastest and slowest differ by more than this share of their median
make a noisy measurement: something else was using the device."""

CHECKPOINT_VALUES_PER_PARAMETER = 5
"""A checkpoint holds, per parameter, fp32 values of: the parameter, AdamW's two
moments, the base and the error-feedback residual."""


def _device(recipe: Recipe) -> str:
    import torch

    if recipe.training.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return recipe.training.device


@dataclass(frozen=True)
class StepTiming:
    """The timed inner steps of :func:`measure_step_seconds`."""

    steps: tuple[float, ...]
    """Seconds of each timed step, after the warm-up."""
    device: str
    threads: int
    """torch's CPU threads while it measured."""

    @property
    def median(self) -> float:
        return statistics.median(self.steps)

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median."""
        return (max(self.steps) - min(self.steps)) / self.median

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD

    def summary(self) -> str:
        """The median and the range, e.g. ``median 2.031 s of 5 timed steps (1.987-2.120 s)``."""
        return (
            f"median {self.median:.3f} s of {len(self.steps)} timed steps "
            f"({min(self.steps):.3f}-{max(self.steps):.3f} s)"
        )


def measure_step_seconds(
    recipe: Recipe,
    warm_steps: int = WARM_STEPS,
    timed_steps: int = TIMED_STEPS,
    say: Callable[[str], None] = lambda line: None,
) -> StepTiming:
    """The compute time of one inner step of the recipe's model on its batch (random
    bytes), on the recipe's device: the step learners run
    (:func:`~diloco_cli.training.inner.inner_step`), with the recipe's AdamW and
    schedule, ``training.loss``, precision, micro-batches and gradient clipping.
    ``say`` is told what is measured before it starts, and the result."""
    import torch

    from diloco_cli.training.inner import InnerSchedule, inner_step, make_inner_optimizer, resolve_loss

    training = recipe.training
    try:
        loss_fn = resolve_loss(training.loss)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    device = _device(recipe)
    threads = torch.get_num_threads()
    if training.threads_per_learner:
        torch.set_num_threads(training.threads_per_learner)
    try:
        torch.manual_seed(training.seed)
        model = recipe.model.build().to(device)
        parameters = sum(parameter.numel() for parameter in model.parameters())
        say(
            f"measuring the inner step of {recipe.model.factory} ({parameters:,} parameters, batch "
            f"{training.batch_size} x {recipe.data.sequence_length}) on {device}"
            + (f" with {torch.get_num_threads()} threads" if device == "cpu" else "")
            + f": {warm_steps} warm-up and {timed_steps} timed steps (--step-seconds S skips this)"
        )
        optimizer = make_inner_optimizer(model, training.learning_rate, training.weight_decay, training.betas)
        schedule = InnerSchedule(
            training.learning_rate, training.warmup_steps, training.inner_steps, training.final_learning_rate_fraction
        )
        windows = torch.randint(
            0,
            256,
            (training.batch_size, recipe.data.sequence_length + 1),
            generator=torch.Generator().manual_seed(training.seed),
        )
        inputs, targets = windows[:, :-1].to(device), windows[:, 1:].to(device)

        def step(number: int) -> float:
            started = time.perf_counter()
            inner_step(
                model,
                optimizer,
                inputs,
                targets,
                schedule.learning_rate(number),
                training.gradient_clip,
                micro_batch_size=training.micro_batch_size,
                precision=training.precision,
                loss_fn=loss_fn,
            )
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - started

        for number in range(warm_steps):
            step(number)
        timing = StepTiming(
            steps=tuple(step(number) for number in range(warm_steps, warm_steps + timed_steps)),
            device=device,
            threads=torch.get_num_threads(),
        )
    finally:
        torch.set_num_threads(threads)
    say(f"inner step: {timing.summary()}")
    if timing.noisy:
        say(
            f"warning: the timed steps differ by {timing.spread:.0%} of their median: something else is using "
            f"the {device}; plan again when it is idle, or give --step-seconds S (1 over the steps/s a running "
            "learner logs)"
        )
    return timing


TensorShapes = list[tuple[str, tuple[int, ...]]]
"""A fragment's tensors: (name, shape), in order."""


def model_fragments(recipe: Recipe, num_fragments: int) -> list[TensorShapes]:
    """The recipe's model split as learners split it (shapes only).  It is built on the
    CPU: building it on the meta device would import torch's reference kernels, a second
    of CPU, more than the default model takes to build."""
    import torch

    from diloco_cli.core.fragments import fragments_of_model

    torch.manual_seed(recipe.training.seed)
    model = recipe.model.build()
    shapes = {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}
    return [
        [(name, shapes[name]) for name in fragment.parameter_names]
        for fragment in fragments_of_model(model, num_fragments)
    ]


def even_fragments(parameters: int, num_fragments: int) -> list[TensorShapes]:
    """N parameters as P fragments of one flat tensor each, as equal as can be."""
    if parameters < num_fragments:
        raise ConfigError(f"--parameters {parameters} cannot be split into {num_fragments} fragments")
    size, extra = divmod(parameters, num_fragments)
    return [[(f"fragment-{p}", (size + (p < extra),))] for p in range(num_fragments)]


SPARSE_ROUNDS = 4
"""Sparse updates sized after this many: the carry of the ones before fills in."""


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _random(shape: tuple[int, ...], generator: torch.Generator, scale: float) -> torch.Tensor:
    import torch

    return torch.randn(shape, generator=generator) * scale


def _best_of(repeats: int, function) -> tuple[float, Any]:
    best, result = math.inf, None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - started)
    return best, result


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread while samples are made and encoded: their tensors are small,
    and on a busy machine torch's worker threads wait on each other for tens of seconds
    (a plan given its step time took 36 s instead of 4 beside other processes)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _frame_parts(frame: bytes) -> tuple[int, int]:
    """(header bytes, body bytes) of an encoded frame."""
    from diloco_cli.codec.frame import PREFIX

    *_, header_bytes, body_bytes = PREFIX.unpack_from(frame)
    return header_bytes, body_bytes


class Sizer:
    """Sizes and times payloads with the real encoder (one run secret, seeded samples)."""

    def __init__(self, secret: RunSecret | None = None, seed: int = 0) -> None:
        self.secret = secret or RunSecret(b"diloco plan: sizes only, no run".ljust(32, b"."))
        self.seed = seed

    def _generator(self):
        import torch

        return torch.Generator().manual_seed(self.seed)

    def _upload(self, tensors: TensorShapes, spec: CodecSpec, meta: Mapping[str, Any]) -> tuple[float, bytes]:
        """A learner's send: ``delta = base - theta + e``, encoded with error feedback."""
        from diloco_cli.codec import encode_payload

        generator = self._generator()
        theta = {name: _random(shape, generator, 0.02) for name, shape in tensors}
        base = {name: t + _random(t.shape, generator, 1e-3) for name, t in theta.items()}
        residual = {name: _random(t.shape, generator, 1e-5) for name, t in theta.items()}

        def encode() -> bytes:
            deltas = ((name, base[name] - theta[name] + residual[name]) for name, _ in tensors)
            return encode_payload(deltas, spec, self.secret, meta, residuals_into=residual)

        return _best_of(3, encode)

    def _update(
        self, tensors: TensorShapes, spec: CodecSpec, meta: Mapping[str, Any], density: float = 1.0
    ) -> tuple[float, bytes]:
        """A published update, and a learner's time to install it: add it to a copy of
        the base, check the digest, copy the result into the parameters.  With ``density``
        below 1 the updates are that sparse (merged top-k sends): the syncer's error
        feedback spreads them, so the update sized is the last of :data:`SPARSE_ROUNDS`."""
        import torch

        from diloco_cli.codec.exact import ExactPublisher, apply_update, fragment_digest
        from diloco_cli.core.types import FragmentIndex

        generator = self._generator()
        publisher = ExactPublisher(spec, self.secret)
        for _ in range(1 if density >= 1 else SPARSE_ROUNDS):
            update = {name: _random(shape, generator, 1e-3) for name, shape in tensors}
            if density < 1:
                update = {name: t * (torch.rand(t.shape, generator=generator) < density) for name, t in update.items()}
            payload = publisher.encode_update(FragmentIndex(0), update, meta)
        base = {name: _random(t.shape, generator, 0.02) for name, t in update.items()}
        parameters = {name: t.clone() for name, t in base.items()}
        names = [name for name, _ in tensors]

        def install() -> None:
            values = {name: t.clone() for name, t in base.items()}
            apply_update(values, payload, self.secret)
            fragment_digest(values, names)
            for name in names:
                parameters[name].copy_(values[name])

        seconds, _ = _best_of(3, install)
        return seconds, payload

    def measure(
        self, kind: str, tensors: TensorShapes, spec: CodecSpec, meta: Mapping[str, Any], density: float = 1.0
    ) -> tuple[int, float]:
        """(bytes, seconds) of one fragment's upload or update (``density``: the share of an
        update's values that are not 0).  A fragment larger than :data:`EXACT_VALUES` is
        sized from its exact layout with the compression and the time per value of a
        :data:`SAMPLE_VALUES` sample, and its header from stand-ins of the same names."""
        from diloco_cli.codec import encode_payload

        def measure(tensors: TensorShapes, spec: CodecSpec, meta: Mapping[str, Any]) -> tuple[float, bytes]:
            return self._upload(tensors, spec, meta) if kind == "upload" else self._update(tensors, spec, meta, density)

        numel = sum(_numel(shape) for _, shape in tensors)
        if numel <= EXACT_VALUES:
            with _one_thread():
                seconds, frame = measure(tensors, spec, meta)
            return len(frame), seconds
        with _one_thread():
            seconds, sample = measure([("sample", (SAMPLE_VALUES,))], spec, meta)
        sample_raw = spec.layout(SAMPLE_VALUES).total_bytes
        ratio = _frame_parts(sample)[1] / sample_raw
        raw = sum(spec.layout(_numel(shape)).total_bytes for _, shape in tensors)
        import torch

        stand_ins = encode_payload(((name, torch.zeros(1)) for name, _ in tensors), spec, self.secret, meta)
        standin_raw = sum(spec.layout(1).total_bytes for _ in tensors)
        header = _frame_parts(stand_ins)[0]
        header += sum(len(json.dumps(list(shape), separators=(",", ":"))) - len("[1]") for _, shape in tensors)
        header += len(str(raw)) - len(str(standin_raw))
        overhead = len(sample) - sum(_frame_parts(sample))
        return overhead + header + round(raw * ratio), seconds * numel / SAMPLE_VALUES

    def snapshot_bytes(self, fragments: Sequence[TensorShapes], meta: Mapping[str, Any]) -> int:
        """A snapshot of every parameter (fp32, zstandard), trained-looking values."""
        tensors = [t for fragment in fragments for t in fragment]
        numel = sum(_numel(shape) for _, shape in tensors)
        with _one_thread():
            return self._whole(tensors, numel, SNAPSHOT_SPEC, meta)

    def _whole(self, tensors: TensorShapes, numel: int, spec: CodecSpec, meta: Mapping[str, Any]) -> int:
        from diloco_cli.codec import encode_payload

        generator = self._generator()
        if numel <= EXACT_VALUES:
            return len(
                encode_payload(
                    ((name, _random(shape, generator, 0.02)) for name, shape in tensors), spec, self.secret, meta
                )
            )
        sample = encode_payload([("sample", _random((SAMPLE_VALUES,), generator, 0.02))], spec, self.secret, meta)
        return round(len(sample) * numel / SAMPLE_VALUES) + 80 * len(tensors)

    def checkpoint_seconds(self, parameters: int) -> float:
        """The training thread's time to encode a checkpoint (fp32, zstandard) of
        :data:`CHECKPOINT_VALUES_PER_PARAMETER` values per parameter."""
        from diloco_cli.codec import encode_payload

        numel = CHECKPOINT_VALUES_PER_PARAMETER * parameters
        sample = min(numel, SAMPLE_VALUES)
        with _one_thread():
            values = _random((sample,), self._generator(), 0.02)
            seconds, _ = _best_of(2, lambda: encode_payload([("sample", values)], SNAPSHOT_SPEC, self.secret, {}))
        return seconds * numel / sample

    def marker_bytes(self, meta: Mapping[str, Any]) -> int:
        from diloco_cli.codec import encode_payload

        return len(encode_payload([], MARKER_SPEC, self.secret, meta))


def _spec_with(spec: CodecSpec, codec: str) -> CodecSpec:
    try:
        return CodecSpec(
            codec=codec, block_size=spec.block_size, keep_per_block=spec.keep_per_block, zstd_level=spec.zstd_level
        )
    except ValueError:  # a block size int4 cannot take: its default
        return CodecSpec(codec=codec, zstd_level=spec.zstd_level)
