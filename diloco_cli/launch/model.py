"""The global model of a run, for the commands that use it here: ``diloco export`` (into
a file, or a directory) and ``diloco sample`` (with a learner's share of this machine's
CPU threads)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from diloco_cli.config.errors import ConfigError
from diloco_cli.launch.local import learner_threads
from diloco_cli.launch.runs import RunRecord
from diloco_cli.store.documents import Head

if TYPE_CHECKING:
    from diloco_cli.runtime.export import Sample

SAFETENSORS_NAME = "model.safetensors"
"""The file ``--format safetensors`` writes into a directory given as its output (the
name a Hugging Face directory gives its weights too)."""


def export_run(record: RunRecord, output: Path, hugging_face: bool, region: str | None) -> tuple[Path, list[Head]]:
    """Write the run's global weights to ``output`` (a ``.safetensors`` file, or
    ``model.safetensors`` in it when it is a directory; with ``hugging_face`` a
    directory); returns where they went and the heads they were read at (one per syncer
    shard)."""
    from diloco_cli.runtime.export import export_hugging_face, export_safetensors

    if hugging_face:
        if output.exists() and not output.is_dir():
            raise ConfigError(f"-o {output}: a file is there; --format hf writes a directory, so name a directory")
        return output, export_hugging_face(record.spec, record.secret(), output, region)
    if output.is_dir():
        output = output / SAFETENSORS_NAME
    return output, export_safetensors(record.spec, record.secret(), output, region)


def sample_run(
    record: RunRecord, prompt: str, length: int, temperature: float, top_k: int, seed: int, past_end: bool = False
) -> tuple[list[Head], Sample]:
    """Continue ``prompt`` with the run's global model, on as many CPU threads as each of
    its learners here gets (torch's default, every core, is several times slower on a
    machine that is busy training), up to the end of the document unless ``past_end``;
    returns the heads the weights were read at (one per syncer shard), and the sample."""
    import torch

    from diloco_cli.runtime.export import global_model, sample_text, sampling_tokenizer

    spec = record.spec
    torch.set_num_threads(learner_threads(spec, "local", os.cpu_count() or 1))
    tokenizer = sampling_tokenizer(spec.recipe.data)
    model, heads = global_model(spec, record.secret())
    return heads, sample_text(
        model, prompt, length, temperature, top_k, seed, spec.recipe.data.sequence_length, tokenizer, past_end
    )
