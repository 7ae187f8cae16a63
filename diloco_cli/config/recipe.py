"""The recipe: what to train (model, data, inner optimization) and how to synchronise it.

Every field has a default; ``recipes/default.yaml`` spells out the defaults, which train
the built-in byte-level GPT (about 0.84M parameters) on the built-in Shakespeare corpus
with 4 learners in a few minutes on a laptop CPU.
"""

from __future__ import annotations

import importlib
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco_cli.codec import Codec, CodecSpec
from diloco_cli.config.credentials import refuse_inline_credentials

FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
"""Every section: read-only once loaded, no unknown key, no nan or infinity in a number."""


class ModelConfig(BaseModel):
    """Which ``torch.nn.Module`` to train."""

    model_config = FROZEN

    factory: str = "diloco_cli.models.gpt:byte_gpt"
    """Import path ``module:callable`` of a function or class that returns the model."""

    kwargs: dict[str, Any] = Field(
        default_factory=lambda: {"num_layers": 4, "width": 128, "num_heads": 4, "context": 128}
    )
    """Keyword arguments passed to the factory."""

    @model_validator(mode="after")
    def _factory_is_an_import_path(self) -> ModelConfig:
        module, separator, attribute = self.factory.partition(":")
        if not separator or not module or not attribute:
            raise ValueError(f"factory must look like 'package.module:callable', got {self.factory!r}")
        return self

    def build(self) -> Any:
        """Import the factory and call it with the keyword arguments."""
        module_name, _, attribute = self.factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"model.factory {self.factory!r} cannot be imported: {error}") from None
        return factory(**self.kwargs)


class DataConfig(BaseModel):
    """Where the training data comes from and how it is cut."""

    model_config = FROZEN

    source: str = "builtin:shakespeare"
    """``builtin:shakespeare`` (ships with diloco), an fsspec URL of a text file (trained
    byte by byte), e.g. ``s3://bucket/corpus.txt``, or the ``index.json`` of a token
    dataset made by ``diloco prepare`` (streamed by ranged reads, never loaded whole)."""

    format: Literal["auto", "text", "tokens"] = "auto"
    """``text`` trains on bytes, ``tokens`` on a prepared token dataset; ``auto`` takes
    ``tokens`` when ``source`` ends in ``.json``."""

    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Options for the filesystem of ``source`` (endpoint, profile); never credentials."""

    sequence_length: int = Field(default=128, ge=2)
    """Tokens (bytes, for text) per training sequence (at most the model's context)."""

    heldout_fraction: float = Field(default=0.05, gt=0, lt=0.5)
    """Text only: the last part of the text kept out of every shard to evaluate the
    global model (a token dataset names its own held-out shard)."""

    chunk_megabytes: float = Field(default=4.0, gt=0)
    """Size of one ranged read of a token dataset's shard (the next chunk is prefetched
    while the current one trains), and the largest block the data is dealt to learners
    in (text too: at least 64 blocks per process where the data allows)."""

    cache_megabytes: float = Field(default=64.0, gt=0)
    """Tokens only: the most shard data a learner process keeps in memory at once."""

    @model_validator(mode="after")
    def _no_inline_credentials(self) -> DataConfig:
        refuse_inline_credentials(self.storage_options, "data.storage_options")
        return self

    @property
    def is_tokens(self) -> bool:
        """Whether ``source`` is a prepared token dataset (else text, trained as bytes)."""
        return self.format == "tokens" or (self.format == "auto" and self.source.split("?")[0].endswith(".json"))


class TrainingConfig(BaseModel):
    """The learners' inner optimization (AdamW with warmup and cosine decay)."""

    model_config = FROZEN

    num_learners: int = Field(default=4, ge=1)
    """M: independent learners, each with its own data shard and inner optimizer."""

    batch_size: int = Field(default=16, ge=1)
    """Sequences per inner step per learner (split across its processes under torchrun)."""

    inner_steps: int = Field(default=300, ge=1)
    """Inner steps each learner takes before it finishes."""

    learning_rate: float = Field(default=6e-3, gt=0)
    """Peak inner AdamW learning rate."""

    warmup_steps: int = Field(default=30, ge=0)
    """Linear warmup of the inner learning rate."""

    final_learning_rate_fraction: float = Field(default=0.1, ge=0, le=1)
    """The cosine decay ends at this fraction of the peak learning rate."""

    weight_decay: float = Field(default=0.1, ge=0)
    """AdamW weight decay, applied to matrices only."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""

    gradient_clip: float | None = Field(default=1.0, gt=0)
    """Clip the gradient norm to this value; null turns clipping off."""

    micro_batch_size: int | None = Field(default=None, ge=1)
    """Sequences per forward and backward pass in each process; gradients of the
    ``batch_size`` sequences accumulate over several passes.  null: the whole batch at once."""

    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16`` runs forward and backward under bf16 autocast (on CUDA; on a CPU too,
    slowly); weights, optimizer state and the outer deltas stay fp32."""

    compile: bool = False
    """Compile the model with ``torch.compile`` (worth it on GPUs for long runs)."""

    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """How the processes of one learner (``processes_per_learner`` > 1) split the work:
    ``ddp`` keeps a whole model in each, ``fsdp`` shards parameters, gradients and
    optimizer state across them (FSDP2) for models that do not fit one GPU."""

    loss: str | None = None
    """Import path ``module:callable`` of ``loss(model, inputs, targets) -> scalar``;
    null is next-token cross-entropy on the logits (or ``.logits``) the model returns."""

    entry_point: str | None = None
    """Run your own training script as each learner instead of the built-in loop: a
    path (relative to the directory ``diloco up`` runs in, the same on every host) of
    a script that uses ``diloco_cli.join`` (see docs/your-own-loop.md)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` uses CUDA when available (one GPU per process), else the CPU."""

    threads_per_learner: int | None = Field(default=None, ge=1)
    """torch CPU threads per learner process; null divides this machine's cores among
    the learners started on it."""

    heartbeat_seconds: float = Field(default=2.0, gt=0)
    """How often a learner writes its heartbeat (step, tokens, loss, speed, state)."""

    checkpoint_every_steps: int = Field(default=100, ge=1)
    """How often a learner checkpoints itself to its region's bucket."""

    poll_seconds: float = Field(default=1.0, gt=0)
    """How often a learner looks for newer global versions."""

    awaiting_poll_seconds: float = Field(default=0.2, gt=0)
    """How often it looks instead while a send of its awaits the merge (from the send to
    the install of a newer version of that fragment): a merge installed sooner, counted in
    the learner's steps, is work trained on fresher weights (docs/benchmarks.md); the
    window is the round trip, a small share of a round where steps are slow, and ends
    when the merge is late (3 of the learner's usual round trips, at least 10 s)."""

    seed: int = 0
    """Seeds the initial model and every learner's data order (mixed with its shard index)."""


class SyncConfig(BaseModel):
    """How the syncer merges: fragments, quorum, grace window, outer optimizer, codecs."""

    model_config = FROZEN

    sync_interval: int = Field(default=25, ge=1)
    """H: inner steps between two sends of the same fragment."""

    sync_interval_schedule: tuple[tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]], ...] = ()
    """A smaller H early in the run: ``[until_step, H]`` pairs, steps increasing: before
    inner step ``until_step`` a learner sends every ``H`` steps (each stage staggered as
    the recipe's H is), from the last ``until_step`` on every ``sync_interval``.  E.g.
    ``[[100, 25], [200, 50]]`` with ``sync_interval: 100``: early sends pull the learners
    together while their deltas are largest, later ones are rare."""

    num_fragments: int = Field(default=2, ge=1)
    """P: fragments sent at staggered steps; 1 sends the whole model at once."""

    shards: int = Field(default=1, ge=1)
    """Syncer shards: N syncer processes, each with its own home and ledger, that share the
    fragments round robin (shard s syncs the fragments p with p % N == s), so the merge
    work and the syncer's WAN traffic scale out.  At most P: a shard without a fragment
    would have nothing to sync.  Where each runs: ``syncer.shard_hosts`` of the region
    file (default: every shard where the syncer goes)."""

    quorum: int | None = Field(default=None, ge=1)
    """K: merge a fragment once this many learners sent it; null means K = M (synchronous
    rounds).  K < M lets fast learners go on without the slow ones."""

    outer_learning_rate: float | Literal["auto"] = "auto"
    """Nesterov outer learning rate; ``auto`` is sqrt(K/M): 1.0 (plain averaging) when
    K = M, 0.5 for K=1 of 4.  With K < M merges come up to M/K times as often, but each
    stale learner's anchored outer gradient also pulls the global model back toward its
    base, so K/M undershoots (measured in bench/quality.py; see docs/algorithm.md)."""

    install: Literal["keep-unsent", "overwrite", "auto"] = "keep-unsent"
    """What a learner does with a newer global version of a fragment.  ``keep-unsent``:
    the global version plus what it trained since its last send of the fragment, which
    its next send carries, so no work is lost.  ``overwrite`` (the paper's rule): its
    parameters become the global version, and what it trained on the fragment between
    its send and the new version's arrival is lost (counted as overwritten tokens): a
    share that grows with a round's latency against a step's time.  ``auto``, the former
    default (overwrite when K = M), now means keep-unsent: measured in bench/quality.py
    at 20 tokens per parameter, overwriting at K = M lost 14% of held-out loss at an
    eighth of the budget (2.538 against 2.183), and with K < M, where versions arrive
    several times per H steps, it loses most of the work (bench/hetero.py)."""

    pace: Literal["auto", "steps", "merges"] = "auto"
    """When a learner sends a fragment.  ``steps``: every H inner steps (fragment p at
    the steps ``p*H/P + k*H``), whatever the merges do.  ``merges``: H steps after the
    first install of the fragment that followed its previous send of it (under K = M,
    the merge of that send's round), or 2H steps after that send if no install came.
    With K = M a round waits for its last learner's send, so by the steps a learner
    ahead of the slowest sends from an older global model, or several times a round; by
    the merges every learner starts its next round from the same install, so every send
    of a round starts from the same model and nobody waits (a round lasts H steps plus a
    merge's round trip; ``diloco plan`` counts the sends by the steps, an upper bound
    here).  ``auto`` (the default): merges when K = M, steps when K < M.  Measured in
    bench/hetero.py at K = M with learners at speeds 1, 1, 0.8 and 0.6, two runs a side:
    1.918 and 1.939 by the merges against 2.216 and 2.385 by the steps; at 20 tokens per
    parameter with equal speeds, 1.551 against the steps' four runs' 1.552."""

    dynamic_local_updates: bool = False
    """Each learner's H scaled by its speed, ``H_m = floor(H * speed_m / fastest)``
    (speeds from the heartbeats' step times; the syncer tells each learner its H_m),
    so a slow learner sends as often in wall time as the fastest: its work reaches
    the global model sooner and less stale."""

    outer_momentum: float = Field(default=0.0, ge=0, lt=1)
    """Nesterov momentum of the outer step (DiLoCo uses 0.9 at large scale; at this
    scale 0.0 was measured best)."""

    merge: Literal["rda", "mean"] = "rda"
    """How arrivals' outer gradients are merged, tensor by tensor: ``rda``
    (radial-directional averaging: the weighted mean's direction at the weighted mean of
    the norms, so the step does not shrink with how many learners happened to arrive;
    the embedding takes the mean) or ``mean`` (the weighted mean of every tensor,
    DiLoCo's own rule)."""

    grace_gamma: float = Field(default=0.5, ge=0, le=1)
    """gamma of the grace window gamma * max(0, tau*xi_step - xi_quorum - xi_sync)."""

    overlap_steps: float = Field(default=2.0, ge=0)
    """tau: inner steps of overlap the grace window may spend waiting for stragglers."""

    max_grace_seconds: float = Field(default=10.0, ge=0)
    """Upper bound of the grace window."""

    liveness_timeout_seconds: float = Field(default=60.0, gt=0)
    """A learner not heard from for this long is not waited for."""

    give_up_seconds: float = Field(default=600.0, ge=0)
    """The run ends without a learner that has failed, stopped or been silent this long
    once every other learner has finished (``diloco resume`` can bring it back); one
    never heard from (a queued job) is not waited for once the others are done."""

    window_versions: int = Field(default=32, ge=1)
    """W: updates kept per fragment to anchor stale learners; older bases must resync."""

    snapshot_every: int = Field(default=20, ge=1)
    """S: a full snapshot every S versions, so a joining learner replays at most S updates."""

    evaluate_every: int = Field(default=4, ge=1)
    """Evaluate the global model on held-out text every this many versions."""

    evaluation_batches: int = Field(default=8, ge=1)
    """Held-out batches (of the training batch size) per evaluation."""

    learner_codec: CodecSpec = CodecSpec(codec=Codec.INT4)
    """Compression of the learners' deltas (with error feedback), and of the regions'
    aggregates (with their reducers' error feedback).  Every region has a reducer: under
    K = M its learners' sends of a fragment cross the WAN as one aggregate per round;
    under K < M each send is relayed as it is, for the syncer to anchor (docs/algorithm.md,
    "Reducers")."""

    forward_window_seconds: float = Field(default=1.0, ge=0)
    """Under K = M, once a region's share of the quorum (ceil(K * M_r / M) of its M_r
    learners: all of its live ones) has sent a fragment, its reducer waits at most this
    long for the others before forwarding what arrived."""

    update_codec: CodecSpec = CodecSpec(codec=Codec.INT8)
    """Compression of the published global updates (made exact for everyone)."""

    merge_threads: int = Field(default=0, ge=0)
    """Threads of a merge round, at the syncer and at each region's reducer: the fused
    decode-anchor-accumulate kernels and the outer step and update encoding run on them
    in fixed chunks, while another thread reads, verifies and decompresses the next
    payload.  0: as many as the process may use (its CPU affinity).  The merged values
    and the published update are the same for any number."""

    poll_seconds: float = Field(default=0.5, gt=0)
    """How often the syncer lists the buckets for arrivals."""

    status_seconds: float = Field(default=2.0, gt=0)
    """How often the syncer writes its status to every region and reads the learners'
    heartbeats: what ``diloco status`` shows is this fresh; over a slow WAN a longer
    interval saves a few KB/s per region."""

    leftover_seconds: float = Field(default=900.0, gt=0)
    """Partial writes, payloads without their marker and stray keys are removed once the
    syncer has seen them this long (longer than any upload in flight can take)."""

    @model_validator(mode="after")
    def _schedule_in_order(self) -> SyncConfig:
        steps = [until for until, _ in self.sync_interval_schedule]
        if any(later <= earlier for earlier, later in zip(steps, steps[1:])):
            raise ValueError(
                f"sync.sync_interval_schedule's steps must increase, got {steps}: "
                "list the stages in order, each [until_step, H]"
            )
        return self


class RetryPolicy(BaseModel):
    """How storage calls are retried (the recipe's ``storage`` section)."""

    model_config = FROZEN

    attempts: int = Field(default=6, ge=1)
    """Tries per storage call before it is reported as failed (1 = no retry)."""

    first_backoff_seconds: float = Field(default=0.5, gt=0)
    """Upper bound of the first random wait; each further wait may be up to twice as long."""

    max_backoff_seconds: float = Field(default=20.0, gt=0)
    """Upper bound of any single wait between two tries."""


class Recipe(BaseModel):
    """A whole training job."""

    model_config = FROZEN

    name: str = Field(default="shakespeare-gpt", pattern=r"^[a-z0-9][a-z0-9-]{0,40}$")
    """Prefix of run names: lowercase letters, digits and dashes."""

    model: ModelConfig = ModelConfig()
    """The model to train."""

    data: DataConfig = DataConfig()
    """The training data."""

    training: TrainingConfig = TrainingConfig()
    """The learners' inner optimization."""

    sync: SyncConfig = SyncConfig()
    """The syncer's merging."""

    storage: RetryPolicy = RetryPolicy()
    """How every storage call of learners and syncer is retried."""

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        if self.sync.shards > self.sync.num_fragments:
            raise ValueError(
                f"sync.shards N={self.sync.shards} exceeds sync.num_fragments P={self.sync.num_fragments}: "
                "each syncer shard syncs whole fragments; lower sync.shards or raise sync.num_fragments"
            )
        quorum = self.sync.quorum
        if quorum is not None and quorum > self.training.num_learners:
            raise ValueError(
                f"sync.quorum K={quorum} cannot exceed training.num_learners M={self.training.num_learners}"
            )
        context = self.model.kwargs.get("context")
        if isinstance(context, int) and self.data.sequence_length > context:
            raise ValueError(f"data.sequence_length {self.data.sequence_length} exceeds model.kwargs.context {context}")
        return self

    @property
    def quorum(self) -> int:
        """K, with null resolved to M."""
        return self.sync.quorum or self.training.num_learners

    @property
    def paces_by_merges(self) -> bool:
        """Whether learners pace their sends by the merges (``sync.pace``, resolved)."""
        return self.sync.pace == "merges" or (self.sync.pace == "auto" and self.quorum >= self.training.num_learners)

    @property
    def keeps_unsent_work(self) -> bool:
        """Whether installs keep the learners' unsent work (``sync.install``, resolved)."""
        return self.sync.install != "overwrite"

    @property
    def outer_learning_rate(self) -> float:
        """The outer learning rate with ``auto`` resolved to sqrt(K/M).

        Why not K/M: a merge of one learner with staleness s (versions published since its
        base) moves the global model by lr * (g - s * x), where g is the learner's own
        progress and x the model's progress per merge (its outer gradient is anchored,
        Decoupled DiLoCo, arXiv 2604.21428).  In steady state x = lr * g / (1 + lr * s),
        so M merges with s = M - 1 advance M * lr / (1 + lr * (M - 1)) of a synchronous
        round: 57% at lr = 1/M for M = 4, but about 80% at lr = 1/sqrt(M) for any M, which
        still averages where lr = 1 would copy the last learner.
        """
        if self.sync.outer_learning_rate == "auto":
            return math.sqrt(self.quorum / self.training.num_learners)
        return float(self.sync.outer_learning_rate)
