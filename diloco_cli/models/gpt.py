"""A small byte-level GPT: the built-in model of the default recipe.

A standard pre-norm decoder-only transformer (GPT-2's layout) over the 256 byte values
(or over the tokens of a ``diloco prepare`` dataset, with ``vocabulary_size``), with
learned positions and the output head tied to the token embedding.  The default
size, 4 layers of width 128 with 4 heads and a context of 128 bytes, has about 0.84M
parameters and trains at a few steps per second on a laptop CPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from diloco_cli.models.context import GPT_DEFAULT_CONTEXT

VOCABULARY_SIZE = 256


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        if width % num_heads:
            raise ValueError(f"width {width} must be divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.num_heads, width // self.num_heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, num_heads)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ByteGPT(nn.Module):
    """A decoder-only transformer over bytes; ``forward(tokens)`` returns logits."""

    def __init__(
        self,
        num_layers: int = 4,
        width: int = 128,
        num_heads: int = 4,
        context: int = 128,
        vocabulary_size: int = VOCABULARY_SIZE,
    ) -> None:
        super().__init__()
        self.context = context
        self.token_embedding = nn.Embedding(vocabulary_size, width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, num_heads) for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary_size, bias=False)
        self.head.weight = self.token_embedding.weight
        self.apply(self._initialise)
        for name, parameter in self.named_parameters():
            if name.endswith("out.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * num_layers))

    @staticmethod
    def _initialise(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.context:
            raise ValueError(f"sequence of {length} tokens exceeds the context of {self.context}")
        positions = torch.arange(length, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def byte_gpt(
    num_layers: int = 4,
    width: int = 128,
    num_heads: int = 4,
    context: int = GPT_DEFAULT_CONTEXT,
    vocabulary_size: int = VOCABULARY_SIZE,
) -> ByteGPT:
    """The factory that recipes name as ``diloco_cli.models.gpt:byte_gpt``."""
    return ByteGPT(
        num_layers=num_layers, width=width, num_heads=num_heads, context=context, vocabulary_size=vocabulary_size
    )
