"""The global model of a run as a ``torch.nn.Module``: for export and for sampling."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from diloco_cli.codec import RunSecret
from diloco_cli.core.fragments import fragments_of_model
from diloco_cli.runtime.global_weights import latest_weights
from diloco_cli.store.run_spec import RunSpec
from diloco_cli.store.documents import Head


def global_model(spec: RunSpec, secret: RunSecret, region: str | None = None) -> tuple[torch.nn.Module, Head]:
    """The recipe's model holding the newest global weights, read from one region."""
    bucket = spec.bucket(region or spec.regions[0].name, secret)
    model = spec.recipe.model.build()
    fragments = fragments_of_model(model, spec.recipe.sync.num_fragments)
    parameters, head = latest_weights(bucket, secret, fragments)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(parameters[name])
    model.eval()
    return model, head


def export_safetensors(spec: RunSpec, secret: RunSecret, output: Path, region: str | None = None) -> Head:
    """Write the global model's ``state_dict`` (every key, tied ones included, so that
    ``model.load_state_dict(safetensors.torch.load_file(path))`` works as is)."""
    model, head = global_model(spec, secret, region)
    tensors = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    metadata = {
        "run": spec.run,
        "version": str(head.version),
        "model_factory": spec.recipe.model.factory,
        "model_kwargs": json.dumps(spec.recipe.model.kwargs),
        "format": "pt",
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output), metadata=metadata)
    return head


@torch.no_grad()
def sample_text(model: torch.nn.Module, prompt: str, new_bytes: int, temperature: float, top_k: int | None, seed: int) -> str:
    """Continue ``prompt`` byte by byte from a byte-level language model."""
    generator = torch.Generator().manual_seed(seed)
    context = getattr(model, "context", 128)
    tokens = torch.tensor([list(prompt.encode("utf-8")) or [10]], dtype=torch.long)
    for _ in range(new_bytes):
        logits = model(tokens[:, -context:])[0, -1].float()
        if temperature <= 0:
            next_token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                threshold = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            next_token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        tokens = torch.cat([tokens, torch.tensor([[next_token]])], dim=1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
