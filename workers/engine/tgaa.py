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
  steps of one request) it reuses them; across requests they are kept per text row (``text_side``: the negative
  prompt of every CFG request, a repeated prompt).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from workers.engine.text_side import TextRows

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
    # the request in progress' text rows, kept across requests (``text_side``); shared with the SRD text hook
    text_rows: TextRows = field(default_factory=TextRows)
    _map_sum: torch.Tensor | None = field(default=None, repr=False)
    _map_terms: int = field(default=0, repr=False)
    _kv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    # per layer: (keys, logit bias) as last seen and what ``_record`` derives from them: the recorded row's keys
    # as (H, d, L) float32 times 1/sqrt(d), and its bias as (1, 1, L) float32
    _map_keys: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = field(
        default_factory=dict, repr=False
    )
    _bias: torch.Tensor | None = field(default=None, repr=False)
    _bias_key: tuple[Any, ...] | None = field(default=None, repr=False)
    _positions: tuple[tuple[int, ...], torch.device, torch.Tensor] | None = field(default=None, repr=False)

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
        """Install a log(α) bias on ``positions`` of ``cond_rows``; returns whether anything was installed.

        The bias of the last call is kept: every TGAA step of a request asks for the same one, and building it
        (three small tensor ops) is a noticeable share of a small Stage-2 step."""
        if alpha == 1.0 or not positions:
            self.bias = None
            return False
        key = (tuple(positions), alpha, batch, text_len, tuple(cond_rows), device, dtype)
        if self._bias_key != key or self._bias is None:
            bias = torch.zeros(batch, 1, 1, text_len, device=device, dtype=dtype)
            pos = torch.tensor(positions, device=device, dtype=torch.long)
            for row in cond_rows:
                bias[row, 0, 0, pos] = math.log(alpha)
            self._bias, self._bias_key = bias, key
        self.bias = self._bias
        return True

    def clear_amplification(self) -> None:
        self.bias = None

    def start_maps(self, positions: list[int], cond_row: int, device: torch.device) -> None:
        key = tuple(positions)
        if self._positions is None or self._positions[:2] != (key, device):
            self._positions = (key, device, torch.tensor(positions, device=device, dtype=torch.long))
        self.map_positions = self._positions[2]
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
        self._map_keys.clear()

    def _accumulate(self, probs_sum: torch.Tensor, terms: int) -> None:
        if self._map_sum is None:
            self._map_sum = probs_sum  # a fresh tensor ``_record`` made: safe to add into
        else:
            self._map_sum.add_(probs_sum)
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
        rows = (
            state.text_rows.project(text, f"kv{self.layer}", lambda row: _project_kv(attn, row))
            if state.cache_kv
            else None
        )
        key, value = _project_kv(attn, text) if rows is None else rows
        if state.cache_kv:
            state._kv[self.layer] = (text, key, value)
        return key, value

    @torch.no_grad()
    def _record(self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> None:
        state = self.state
        assert state.map_positions is not None
        row = state.cond_row
        s_len, heads, dim = query.shape[1:]
        keys_t, bias = self._map_keys(key, mask, row, dim)  # (H, d, L), (1, 1, L) or None
        l_len = keys_t.shape[2]
        q = query[row].float().transpose(0, 1)  # (H, S, d)
        chunk = max(1, _MAP_CHUNK_ELEMENTS // max(1, s_len * l_len))
        total = None
        for h0 in range(0, heads, chunk):
            kh = keys_t[h0 : h0 + chunk]
            qh = q[h0 : h0 + chunk]
            logits = torch.bmm(qh, kh) if bias is None else torch.baddbmm(bias, qh, kh)  # (h, S, L)
            probs = torch.softmax(logits, dim=-1).sum(0).index_select(1, state.map_positions)  # (S, V)
            total = probs if total is None else total + probs
        assert total is not None
        state._accumulate(total, heads)

    def _map_keys(
        self, key: torch.Tensor, mask: torch.Tensor | None, row: int, dim: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The recorded row's keys, transposed for ``bmm`` and pre-scaled by 1/sqrt(d), and its logit bias; kept
        per layer while the keys are the very same tensor (the K/V cache hands the same one to every step of a
        request) and the bias too, since these few small ops repeat in every block of every pass otherwise."""
        state = self.state
        cached = state._map_keys.get(self.layer)
        if cached is not None and cached[0] is key and cached[1] is mask:
            return cached[2], cached[3]
        keys_t = (key[row].float() * (1.0 / math.sqrt(dim))).permute(1, 2, 0).contiguous()
        bias = mask[row].float().reshape(1, 1, -1) if mask is not None else None
        state._map_keys[self.layer] = (key, mask, keys_t, bias)
        return keys_t, bias


def _project_kv(attn: Any, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The text's cross-attention keys (normalized) and values, per head: a row-wise function of ``text``."""
    if getattr(attn, "fused_projections", False):
        # contiguous copies: halves of one buffer would keep all of it alive in the text-side cache
        key, value = (t.contiguous() for t in attn.to_kv(text).chunk(2, dim=-1))
    else:
        key, value = attn.to_k(text), attn.to_v(text)
    return attn.norm_k(key).unflatten(2, (attn.heads, -1)), value.unflatten(2, (attn.heads, -1))


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
