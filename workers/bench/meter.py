"""Counts the transformer work actually done: block calls and the tokens each call processed.

A forward hook on every transformer block records the sequence length of its output (after SRD gathering, so a
Stage-2 pass over 30% of the tokens counts 30%). A method's compute is then comparable across Chorus (fewer
steps, fewer tokens), cache-dit (fewer blocks) and both together:

    block_token_fraction = Σ tokens processed by blocks / (steps × blocks × sequence length)

The batch (2 rows with classifier-free guidance) is the same for every method and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class MeterReading:
    block_calls: int
    block_tokens: int


class BlockMeter:
    """Forward hooks on ``transformer.blocks``; ``reading()`` since the last ``reset()``."""

    def __init__(self, transformer: Any) -> None:
        self.blocks: list[torch.nn.Module] = list(transformer.blocks)
        self.calls = 0
        self.tokens = 0
        self._handles = [b.register_forward_hook(self._hook) for b in self.blocks]

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        self.calls += 1
        self.tokens += int(hidden.shape[1])

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def reset(self) -> None:
        self.calls = 0
        self.tokens = 0

    def reading(self) -> MeterReading:
        return MeterReading(self.calls, self.tokens)

    def fraction(self, steps: int, seq_len: int) -> float:
        """Work done as a fraction of ``steps`` full passes over ``seq_len`` tokens."""
        full = steps * self.num_blocks * seq_len
        return self.tokens / full if full else 0.0

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
