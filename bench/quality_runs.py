"""The runs of the quality benchmark: one training run each, a loss curve back.

Data-parallel and the floor (one learner alone) train in this process: data-parallel as
one process with the global batch is the same mathematics as DDP over M workers, and one
learner alone is exactly what a learner does between merges.  The DiLoCo runs go through
the product (``diloco up`` on this machine, its learners, reducers and syncer as
processes, ``file://`` buckets) and read the syncer's evaluations of the published model.

Every run returns its curve: ``evaluations``, a list of ``[tokens, loss]`` (tokens summed
over learners, loss in nats per byte or token on the held-out split).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench._common import local_regions
from diloco_cli.codec import RunSecret, decode_payload, encode_payload
from diloco_cli.codec.aggregate import decode_aggregate, encode_aggregate, residual_names
from diloco_cli.codec.exact import ExactPublisher, apply_update
from diloco_cli.config.recipe import Recipe
from diloco_cli.core.fragments import fragments_due, fragments_of_model
from diloco_cli.core.merge import MergeAccumulator, radial_directional_average
from diloco_cli.core.outer import nesterov_step_
from diloco_cli.data.corpora import builtin_corpus
from diloco_cli.data.learner import MEGABYTE
from diloco_cli.data.text import TextSplit, evaluation_batches, load_text, random_batch
from diloco_cli.launch.operations import stop_run
from diloco_cli.launch.runs import load_run
from diloco_cli.launch.up import launch
from diloco_cli.training.inner import InnerSchedule, evaluate, inner_step, make_inner_optimizer
from diloco_cli.views.run_state import collect_status

CURVE_POINTS = 32
"""Evaluations per in-process run (and about as many per DiLoCo run): enough to read the
tokens a run needs to reach a loss to within 1/32 of its budget."""


@dataclass(frozen=True)
class InProcess:
    """One AdamW trainer in this process: data-parallel (the global batch) or one learner
    alone (a learner's batch, a learner's share of the tokens)."""

    learning_rate: float
    batch: int
    tokens: float
    """The run's whole budget: its schedule ends here."""
    stop: float = 1.0
    """The fraction of the budget trained (tuning stops early on the full schedule)."""


def train_in_process(recipe: Recipe, run: InProcess) -> dict:
    """Train ``run`` on ``recipe``'s model, data and inner schedule (warmup, cosine to the
    final fraction, weight decay, clipping), evaluating ``CURVE_POINTS`` times."""
    torch.manual_seed(recipe.training.seed)
    training, length = recipe.training, recipe.data.sequence_length
    model = recipe.model.build()
    split = TextSplit.of(load_text(recipe.data.source), recipe.data.heldout_fraction, length)
    heldout = evaluation_batches(split.heldout, training.batch_size, length, recipe.sync.evaluation_batches)
    steps = max(1, round(run.tokens / (run.batch * length)))
    optimizer = make_inner_optimizer(model, run.learning_rate, training.weight_decay, training.betas)
    schedule = InnerSchedule(run.learning_rate, training.warmup_steps, steps, training.final_learning_rate_fraction)
    generator = torch.Generator().manual_seed(training.seed)
    last = max(1, round(steps * run.stop))
    marks = {max(1, round(steps * point / CURVE_POINTS)) for point in range(1, CURVE_POINTS + 1)} | {last}
    evaluations, started = [], time.monotonic()
    for step in range(1, last + 1):
        inputs, targets = random_batch(split.train, run.batch, length, generator)
        inner_step(model, optimizer, inputs, targets, schedule.learning_rate(step - 1), training.gradient_clip)
        if step in marks:
            evaluations.append([step * run.batch * length, evaluate(model, heldout)])
    return {"tokens": steps * run.batch * length, "seconds": time.monotonic() - started, "evaluations": evaluations}


@dataclass(frozen=True)
class Lockstep:
    """DiLoCo's mathematics alone, in this process: M learners step in lockstep, every
    H steps their outer gradients are merged (in fp32, all learners at once) and the
    global model takes the Nesterov outer step, and each goes on from it; each samples
    the whole text.  By default no quantization, no dealt shares, no processes or
    buckets: what is left of a row's gap to data-parallel here is the algorithm's, the
    rest the system's.
    ``fragments``, ``delay_steps``, ``dealt`` and ``codecs`` put back parts of the system
    one at a time."""

    learners: int
    learning_rate: float
    batch: int
    """Per learner."""
    sync_interval: int
    outer_learning_rate: float
    outer_momentum: float
    tokens: float
    stop: float = 1.0
    merge: str = "mean"
    """``mean``: the plain mean of the learners' outer gradients; ``rda``: the product's
    merge (the embedding's mean, radial-directional averaging for every other tensor)."""
    fragments: int = 1
    """Streamed fragments, sent on the product's staggered schedule (fragment p at the
    steps where ``(step - p*H//P) % H == 0``)."""
    delay_steps: int = 0
    """Steps between a merge and its install: a learner then keeps what it trained since
    its send, as the product's ``sync.install: keep-unsent`` does."""
    dealt: bool = False
    """Each learner draws its windows from its own share of the text, the blocks dealt
    to it as the product deals them (``TextSplit.share``), instead of from the whole."""
    codecs: bool = False
    """The product's codecs on the way: each learner's outer gradient in
    ``sync.learner_codec`` with its error feedback, each region's aggregate of them (the
    learners split over two regions as a local run splits them) in the same codec with
    its reducer's error feedback, and the update in ``sync.update_codec``, applied
    exactly with its carry (:class:`LockstepCodecs`)."""


class LockstepCodecs:
    """The product's quantization of one round, with the product's own functions: a
    learner's send (:func:`encode_payload` with its residual), its region's aggregate
    (:func:`encode_aggregate` with the reducer's residual) and the published update
    (:class:`ExactPublisher` and :func:`apply_update`)."""

    def __init__(self, recipe: Recipe, learners: int) -> None:
        self.secret = RunSecret(bytes(range(32)))
        self.learner_codec = recipe.sync.learner_codec
        self.publisher = ExactPublisher(recipe.sync.update_codec, self.secret)
        first_region = learners - learners // 2  # local-a takes the odd one (bench._common.local_regions)
        self.regions = [range(first_region), range(first_region, learners)]
        self.learner_residuals: dict[tuple[int, str], torch.Tensor] = {}
        self.region_residuals: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def merged(self, fragment, outer_gradients: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The merged outer gradient of ``fragment`` as the syncer reads it from the
        regions' aggregates of the learners' quantized sends (equal weights)."""
        shapes = {name: tuple(tensor.shape) for name, tensor in outer_gradients[0].items()}
        syncer = MergeAccumulator(shapes, fragment.mean_names)
        for region, members in enumerate(self.regions):
            reducer = MergeAccumulator(shapes, fragment.mean_names)
            for learner in members:
                residuals = {
                    name: self.learner_residuals.setdefault((learner, name), torch.zeros(shape))
                    for name, shape in shapes.items()
                }
                sent = ((name, tensor + residuals[name]) for name, tensor in outer_gradients[learner].items())
                payload = encode_payload(sent, self.learner_codec, self.secret, residuals_into=residuals)
                reducer.add(decode_payload(payload, self.secret).tensors, 1.0)
            names = residual_names(shapes, fragment.mean_names)
            residuals = self.region_residuals.setdefault(
                (region, fragment.index),
                {name: torch.zeros(shapes[name.split("/", 1)[1]]) for name in names},
            )
            payload = encode_aggregate(reducer.partial(), self.learner_codec, self.secret, {}, residuals=residuals)
            syncer.add_partial(decode_aggregate(payload, self.secret)[0])
        return syncer.result()

    def publish(self, fragment, parameters: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        """``parameters`` moved towards ``new`` by the quantized update, as every holder
        of the global weights moves them."""
        update = {name: new[name] - parameters[name] for name in new}
        apply_update(parameters, self.publisher.encode_update(fragment.index, update), self.secret)


@dataclass
class _Install:
    at_step: int
    indices: list[int]
    sent: list[list[torch.Tensor]]
    """Per learner, its values of the fragment's tensors when it sent them."""
    merged: list[torch.Tensor]


def train_lockstep(recipe: Recipe, run: Lockstep) -> dict:
    """Train ``run`` on ``recipe``'s model, data and inner schedule, evaluating the global
    model ``CURVE_POINTS`` times (between merges it is the last ones')."""
    torch.manual_seed(recipe.training.seed)
    training, length = recipe.training, recipe.data.sequence_length
    global_model = recipe.model.build()
    split = TextSplit.of(load_text(recipe.data.source), recipe.data.heldout_fraction, length)
    heldout = evaluation_batches(split.heldout, training.batch_size, length, recipe.sync.evaluation_batches)
    steps = max(1, round(run.tokens / (run.learners * run.batch * length)))
    models = [copy.deepcopy(global_model) for _ in range(run.learners)]
    optimizers = [make_inner_optimizer(m, run.learning_rate, training.weight_decay, training.betas) for m in models]
    schedule = InnerSchedule(run.learning_rate, training.warmup_steps, steps, training.final_learning_rate_fraction)
    generators = [torch.Generator().manual_seed(training.seed * 1000 + i) for i in range(run.learners)]
    texts = [
        split.share(i, run.learners, training.seed, block_bytes=int(recipe.data.chunk_megabytes * MEGABYTE))
        if run.dealt
        else split.train
        for i in range(run.learners)
    ]
    names = [name for name, _ in global_model.named_parameters()]
    parameters = [list(model.parameters()) for model in models]
    global_parameters = list(global_model.parameters())
    buffers = [torch.zeros_like(p) for p in global_parameters]
    fragments = fragments_of_model(global_model, run.fragments, run.merge)
    codecs = LockstepCodecs(recipe, run.learners) if run.codecs else None
    stepped: set[int] = set()
    pending: list[_Install] = []
    last = max(1, round(steps * run.stop))
    marks = {max(1, round(steps * point / CURVE_POINTS)) for point in range(1, CURVE_POINTS + 1)} | {last}
    evaluations, started = [], time.monotonic()
    for step in range(1, last + 1):
        for model, optimizer, generator, text in zip(models, optimizers, generators, texts):
            inputs, targets = random_batch(text, run.batch, length, generator)
            inner_step(model, optimizer, inputs, targets, schedule.learning_rate(step - 1), training.gradient_clip)
        due = range(run.fragments) if step == last else fragments_due(step, run.sync_interval, run.fragments)
        with torch.no_grad():
            for fragment in (fragments[p] for p in due):
                indices = [names.index(name) for name in fragment.parameter_names]
                sent = [[learner[i].detach().clone() for i in indices] for learner in parameters]
                outer_gradients = [
                    {names[i]: global_parameters[i] - values[k] for k, i in enumerate(indices)} for values in sent
                ]
                if codecs is not None:
                    merged_gradients = codecs.merged(fragment, outer_gradients)
                else:
                    merged_gradients = {
                        name: torch.stack([gradients[name] for gradients in outer_gradients]).mean(0)
                        if name in fragment.mean_names
                        else radial_directional_average(
                            [gradients[name] for gradients in outer_gradients], [1.0] * run.learners
                        )
                        for name in outer_gradients[0]
                    }
                stepped_to = {}
                for i in indices:
                    stepped_to[names[i]] = nesterov_step_(
                        merged_gradients[names[i]],
                        buffers[i],
                        global_parameters[i],
                        run.outer_learning_rate,
                        run.outer_momentum,
                        first=i not in stepped,
                    )
                    stepped.add(i)
                if codecs is not None:
                    codecs.publish(fragment, {names[i]: global_parameters[i].data for i in indices}, stepped_to)
                else:
                    for i in indices:
                        global_parameters[i].copy_(stepped_to[names[i]])
                merged = [global_parameters[i].detach().clone() for i in indices]
                pending.append(_Install(step + run.delay_steps, indices, sent, merged))
            for install in [install for install in pending if install.at_step <= step or step == last]:
                for learner, sent in zip(parameters, install.sent):  # keep what was trained since the send
                    for k, i in enumerate(install.indices):
                        learner[i].copy_(install.merged[k] + (learner[i] - sent[k]))
                pending.remove(install)
        if step in marks:
            evaluations.append([step * run.learners * run.batch * length, evaluate(global_model, heldout)])
    tokens = steps * run.learners * run.batch * length
    return {"tokens": tokens, "seconds": time.monotonic() - started, "evaluations": evaluations}


def train_diloco(recipe: Recipe, name: str, workdir: Path, stop: float = 1.0) -> dict:
    """Train through the real CLI path (processes, buckets) and read the syncer's
    evaluations; with ``stop`` below 1 the run is stopped once the published model was
    evaluated past that fraction of the budget."""
    recipe_path = workdir / f"{name}.json"
    recipe_path.write_text(recipe.model_dump_json())
    started = time.monotonic()
    regions = local_regions(workdir, recipe.training.num_learners)
    result = launch(recipe_path, regions, [], name, workdir / "runs", dry_run=False)
    budget = diloco_tokens(recipe)
    while True:
        status = collect_status(result.spec)
        if status.state in ("finished", "stopped"):
            break
        if stop < 1 and any(e["tokens"] >= stop * budget for e in status.evaluations):
            break
        time.sleep(2)
    # every process down before the caller removes the buckets: a reducer still finishing
    # when its bucket vanished was left retrying, supervised, after the benchmark ended
    stop_run(load_run(workdir / "runs", name))
    return {
        "tokens": budget,
        "versions": status.version,
        "seconds": time.monotonic() - started,
        "evaluations": [[e["tokens"], e["loss"]] for e in status.evaluations],
        "install_lag_steps": {row.learner: row.install_lag_steps for row in status.learners},
    }


def diloco_tokens(recipe: Recipe) -> int:
    """The tokens a DiLoCo run's learners train in all."""
    training = recipe.training
    return training.num_learners * training.inner_steps * training.batch_size * recipe.data.sequence_length


def loss_at(evaluations: list[list[float]], tokens: float) -> float:
    """The loss at ``tokens``, linear between the two evaluations that straddle it (the
    last one past the curve's end): an evaluation is labelled with the tokens trained when
    it was taken, about 3% of the budget apart, where the loss still falls by a few
    percent; taking the first evaluation past the point instead made two runs of one
    setting differ by that much."""
    previous = None
    for at, loss in evaluations:
        if at >= tokens * (1 - 1e-9):
            if previous is None or at == previous[0]:
                return loss
            (before, loss_before) = previous
            return loss_before + (loss - loss_before) * (tokens - before) / (at - before)
        previous = (at, loss)
    return evaluations[-1][1]


def tokens_to_reach(evaluations: list[list[float]], target: float) -> float | None:
    """The tokens at which the curve first reaches ``target`` (linear between the two
    evaluations that straddle it), or None where it never does."""
    previous = None
    for tokens, loss in evaluations:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(tokens)
            (tokens_before, loss_before) = previous
            return tokens_before + (tokens - tokens_before) * (loss_before - target) / (loss_before - loss)
        previous = (tokens, loss)
    return None


def prepare_tokens(workdir: Path, vocabulary: int) -> tuple[str, float]:
    """``diloco prepare`` on the built-in corpus: the dataset's index and the held-out
    text's bytes per token (to turn nats per token into bits per byte)."""
    import numpy as np
    from tokenizers import Tokenizer

    corpus, dataset = workdir / "corpus.txt", workdir / "tokens"
    corpus.write_bytes(builtin_corpus("shakespeare"))
    command = [sys.executable, "-m", "diloco_cli", "prepare", str(corpus), "-o", str(dataset)]
    command += ["--vocab-size", str(vocabulary), "--heldout-fraction", "0.05"]
    subprocess.run(command, check=True, capture_output=True)
    index = json.loads((dataset / "index.json").read_text())
    heldout = np.fromfile(dataset / index["heldout"]["name"], dtype=index["dtype"])
    text = Tokenizer.from_file(str(dataset / index["tokenizer"])).decode(heldout.tolist(), skip_special_tokens=False)
    return str(dataset / "index.json"), len(text.encode("utf-8")) / len(heldout)
