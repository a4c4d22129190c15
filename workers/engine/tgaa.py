"""Token-Guided Attention Amplification (TGAA) and cross-attention map recording, as an ``attn2`` processor.

``ChorusCrossAttnProcessor`` replaces diffusers' ``WanAttnProcessor`` on every block's cross-attention
(``blocks.N.attn2``) through ``set_attn_processor``. It computes exactly what ``WanAttnProcessor`` computes for
text-to-video cross-attention, plus, driven by a shared ``CrossAttnState``:

- **amplification**: an additive bias ``log(α)`` on the logits of the key positions of the prompt tokens that
  differ from the donor's prompt, on the conditional batch row(s) only. Softmax then multiplies the attention
  on those keys by α and renormalizes. α = 1 (or no differing token) passes no mask at all: a no-op.
- **map recording**: the softmax attention probability of each latent query token on each valid prompt token,
  conditional row only, summed over heads and blocks (``collect_maps`` averages); computed from ``q·k`` in float32
  in head chunks, so it never materializes more than ~32M logits at once.
- **text K/V cache**: the key/value projections of the prompt depend only on the prompt, so when the processor
  sees the very same ``encoder_hidden_states`` tensor again (the SRD text cache hook guarantees that across the
  steps of one request) it reuses them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

log = logging.getLogger(__name__)

_MAP_CHUNK_ELEMENTS = 32 * 1024 * 1024


@dataclass
class CrossAttnState:
    """Shared state of all ``ChorusCrossAttnProcessor`` instances of one transformer."""

    # (B, 1, 1, L) additive logit bias, or None (no amplification)
    bias: torch.Tensor | None = None
    # record maps of these key positions (valid prompt tokens) for batch row ``cond_row``
    map_positions: torch.Tensor | None = None
    cond_row: int = 0
    # query-token indices the maps refer to (None: all tokens, in order)
    cache_kv: bool = True
    _map_sum: torch.Tensor | None = field(default=None, repr=False)
    _map_terms: int = field(default=0, repr=False)
    _kv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def set_amplification(
        self,
        positions: list[int],
        alpha: float,
        batch: int,
        text_len: int,
        cond_rows: list[int],
        device: torch.device,
        dtype: torch.dtype,
    ) -> bool:
        """Install a log(α) bias on ``positions`` of ``cond_rows``; returns whether anything was installed."""
        if alpha == 1.0 or not positions:
            self.bias = None
            return False
        bias = torch.zeros(batch, 1, 1, text_len, device=device, dtype=dtype)
        pos = torch.tensor(positions, device=device, dtype=torch.long)
        for row in cond_rows:
            bias[row, 0, 0, pos] = math.log(alpha)
        self.bias = bias
        return True

    def clear_amplification(self) -> None:
        self.bias = None

    def start_maps(self, positions: list[int], cond_row: int, device: torch.device) -> None:
        self.map_positions = torch.tensor(positions, device=device, dtype=torch.long)
        self.cond_row = cond_row
        self._map_sum = None
        self._map_terms = 0

    def stop_maps(self) -> None:
        self.map_positions = None
        self._map_sum = None
        self._map_terms = 0

    def collect_maps(self) -> torch.Tensor | None:
        """``(V, S_computed)`` averaged maps of the call(s) since ``start_maps``; stops recording."""
        out = None
        if self._map_sum is not None and self._map_terms > 0:
            out = (self._map_sum / self._map_terms).transpose(0, 1).contiguous()
        self.stop_maps()
        return out

    def clear_kv_cache(self) -> None:
        self._kv.clear()

    def _accumulate(self, probs_sum: torch.Tensor, terms: int) -> None:
        if self._map_sum is None:
            self._map_sum = probs_sum
        else:
            self._map_sum = self._map_sum + probs_sum
        self._map_terms += terms


class ChorusCrossAttnProcessor:
    """``attn2`` processor: WanAttnProcessor's text-to-video cross-attention + TGAA bias + map recording."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, state: CrossAttnState, layer: int) -> None:
        self.state = state
        self.layer = layer

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is None:
            raise ValueError("ChorusCrossAttnProcessor is for cross-attention (attn2) only")
        if attn.add_k_proj is not None:
            raise NotImplementedError("image-conditioned (I2V) Wan cross-attention is not supported")
        state = self.state

        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key, value = self._key_value(attn, encoder_hidden_states)
        if rotary_emb is not None:
            raise ValueError("cross-attention takes no rotary embedding")

        mask = state.bias
        if mask is not None:
            mask = mask.to(query.dtype)
        if attention_mask is not None:
            mask = attention_mask if mask is None else mask + attention_mask

        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=None,
        )
        if state.map_positions is not None:
            self._record(query, key, mask)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        result: torch.Tensor = attn.to_out[1](out)
        return result

    def _key_value(self, attn: Any, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.state
        cached = state._kv.get(self.layer) if state.cache_kv else None
        if cached is not None and cached[0] is text:
            return cached[1], cached[2]
        if getattr(attn, "fused_projections", False):
            key, value = attn.to_kv(text).chunk(2, dim=-1)
        else:
            key, value = attn.to_k(text), attn.to_v(text)
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if state.cache_kv:
            state._kv[self.layer] = (text, key, value)
        return key, value

    @torch.no_grad()
    def _record(self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> None:
        state = self.state
        assert state.map_positions is not None
        row = state.cond_row
        q = query[row].float()  # (S, H, d)
        k = key[row].float()  # (L, H, d)
        s_len, heads, dim = q.shape
        l_len = k.shape[0]
        bias = mask[row].float().reshape(1, 1, -1) if mask is not None else None
        scale = 1.0 / math.sqrt(dim)
        chunk = max(1, _MAP_CHUNK_ELEMENTS // max(1, s_len * l_len))
        total = None
        for h0 in range(0, heads, chunk):
            qh = q[:, h0 : h0 + chunk].transpose(0, 1)  # (h, S, d)
            kh = k[:, h0 : h0 + chunk].transpose(0, 1)  # (h, L, d)
            logits = torch.bmm(qh, kh.transpose(1, 2)) * scale  # (h, S, L)
            if bias is not None:
                logits = logits + bias
            probs = torch.softmax(logits, dim=-1).index_select(2, state.map_positions).sum(0)  # (S, V)
            total = probs if total is None else total + probs
        assert total is not None
        state._accumulate(total, heads)


def install_cross_attn_processors(transformer: Any, state: CrossAttnState) -> dict[str, Any]:
    """Put a ``ChorusCrossAttnProcessor`` on every ``blocks.N.attn2``; returns the processors it replaced."""
    current = dict(transformer.attn_processors)
    previous = {}
    for name in list(current):
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blocks" and parts[2] == "attn2":
            previous[name] = current[name]
            current[name] = ChorusCrossAttnProcessor(state, layer=int(parts[1]))
    if not previous:
        raise ValueError("transformer has no blocks.N.attn2 cross-attention")
    transformer.set_attn_processor(current)
    log.debug("TGAA processors installed", extra={"cross_attention_layers": len(previous)})
    return previous


def restore_processors(transformer: Any, previous: dict[str, Any]) -> None:
    current = dict(transformer.attn_processors)
    current.update(previous)
    transformer.set_attn_processor(current)
