"""Selective region denoising (SRD) as diffusers hooks on ``WanTransformer3DModel``.

The transformer's own forward runs unchanged; hooks registered with ``diffusers.hooks.HookRegistry`` make it
compute only a subset of latent tokens when an ``SRDContext`` says so:

- ``blocks[0]`` (head hook): gathers the active tokens of ``hidden_states`` (after patch embedding), so every
  block runs on ``(B, S_active, D)``;
- every block (rope hook): replaces the full-grid rotary embedding ``(cos, sin)`` of shape ``(1, S, 1, d)`` by its
  rows at the active token indices — each gathered token keeps its true 3-D (frame, row, column) position;
- ``proj_out`` (tail hook): scatters the ``(B, S_active, C·p)`` projection back to ``(B, S, C·p)`` (zeros at
  inactive tokens, which the engine replaces by the donor's model output) so unpatchify sees the full grid;
- ``condition_embedder.text_embedder`` (text cache hook): returns the cached text projection when it is called
  again on the very same prompt tensor (it does not depend on the timestep), so it is computed once per request,
  and per text row across requests where the engine named the rows (``text_side``);
- ``rope`` (rope cache hook): the full-grid rotary table depends only on the latent's shape (the module reads
  nothing else of its input), so it is built once per shape instead of on every pass.

With ``SRDContext.active_index`` = None every hook is a pass-through. The context is only valid for Wan2.1-style
per-sample timestep embeddings (``temb`` of shape ``(B, 6, D)``); the engine always passes those.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from workers.engine.text_side import TextRows

log = logging.getLogger(__name__)

HEAD_HOOK = "chorus_srd_head"
ROPE_HOOK = "chorus_srd_rope"
TAIL_HOOK = "chorus_srd_tail"
TEXT_HOOK = "chorus_text_cache"
ROPE_CACHE_HOOK = "chorus_rope_cache"


@dataclass
class SRDContext:
    """Shared, mutable state of the SRD hooks for the transformer call in progress."""

    active_index: torch.Tensor | None = (
        None  # sorted LongTensor of active token indices, on the model's device
    )
    seq_len: int = 0
    cache_text: bool = True
    # the request in progress' text rows, kept across requests (``text_side``); shared with the attn2 processors
    text_rows: TextRows = field(default_factory=TextRows)
    _rope: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _text_in: torch.Tensor | None = field(default=None, repr=False)
    _text_out: torch.Tensor | None = field(default=None, repr=False)

    def activate(self, active_index: torch.Tensor, seq_len: int) -> None:
        if active_index.ndim != 1:
            raise ValueError("active_index must be 1-D")
        self.active_index = active_index
        self.seq_len = seq_len
        self._rope = None

    def deactivate(self) -> None:
        self.active_index = None
        self._rope = None

    def clear_text_cache(self) -> None:
        self._text_in = None
        self._text_out = None

    def gather_rope(self, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.active_index is not None
        if self._rope is None:
            cos, sin = rope
            if cos.shape[1] != self.seq_len:
                raise RuntimeError(
                    f"SRD: rotary embedding covers {cos.shape[1]} tokens, expected {self.seq_len}"
                )
            idx = self.active_index
            self._rope = (cos.index_select(1, idx), sin.index_select(1, idx))
        return self._rope


_BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "temb", "rotary_emb")


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(zip(_BLOCK_ARGS, args, strict=False))
    bound.update(kwargs)
    return bound


class _HeadGatherHook(ModelHook):
    """On the first block: keep only the active tokens of ``hidden_states``."""

    def __init__(self, ctx: SRDContext) -> None:
        super().__init__()
        self.ctx = ctx

    def pre_forward(
        self, module: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ctx = self.ctx
        if ctx.active_index is None:
            return args, kwargs
        b = _bind(args, kwargs)
        hidden = b["hidden_states"]
        if hidden.shape[1] != ctx.seq_len:
            raise RuntimeError(f"SRD: transformer produced {hidden.shape[1]} tokens, expected {ctx.seq_len}")
        if b["temb"].ndim != 3:
            raise NotImplementedError("SRD supports per-sample timestep embeddings only (Wan2.1-style)")
        b["hidden_states"] = hidden.index_select(1, ctx.active_index)
        return (), b


class _RopeGatherHook(ModelHook):
    """On every block: the rotary embedding rows of the active tokens (their true 3-D positions)."""

    def __init__(self, ctx: SRDContext) -> None:
        super().__init__()
        self.ctx = ctx

    def pre_forward(
        self, module: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.ctx.active_index is None:
            return args, kwargs
        b = _bind(args, kwargs)
        b["rotary_emb"] = self.ctx.gather_rope(b["rotary_emb"])
        return (), b


class _TailScatterHook(ModelHook):
    """On ``proj_out``: put the active tokens' projections back on the full token grid."""

    def __init__(self, ctx: SRDContext) -> None:
        super().__init__()
        self.ctx = ctx

    def post_forward(self, module: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        if ctx.active_index is None:
            return output
        full = output.new_zeros(output.shape[0], ctx.seq_len, output.shape[2])
        return full.index_copy_(1, ctx.active_index, output)


class _TextCacheHook(ModelHook):
    """On ``condition_embedder.text_embedder``: compute the text projection once per prompt tensor."""

    def __init__(self, ctx: SRDContext) -> None:
        super().__init__()
        self.ctx = ctx

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        ctx = self.ctx
        text = args[0] if args else next(iter(kwargs.values()))
        if ctx.cache_text and ctx._text_in is text and ctx._text_out is not None:
            return ctx._text_out
        forward: Any = self.fn_ref.original_forward
        rows = ctx.text_rows.project(text, "text", lambda row: (forward(row),)) if ctx.cache_text else None
        out = forward(*args, **kwargs) if rows is None else rows[0]
        if ctx.cache_text:
            ctx._text_in, ctx._text_out = text, out
        if rows is not None:
            ctx.text_rows.derived(out)  # the cross-attention keys and values are row-wise functions of it
        return out


class _RopeCacheHook(ModelHook):
    """On ``rope``: ``WanRotaryPosEmbed.forward`` reads only its input's shape, and rebuilding the (float64)
    table (two concatenations over the whole grid) is a fixed cost of every pass, SRD or not; one table per shape
    is kept."""

    def __init__(self) -> None:
        super().__init__()
        self._key: tuple[Any, ...] | None = None
        self._out: Any = None

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else next(iter(kwargs.values()))
        freqs: Any = module.freqs_cos
        key = (tuple(hidden.shape), hidden.device, freqs.data_ptr())
        if key != self._key:
            forward: Any = self.fn_ref.original_forward
            self._out, self._key = forward(*args, **kwargs), key
        return self._out


def apply_srd_hooks(transformer: Any, ctx: SRDContext) -> None:
    """Register the SRD and text-cache hooks on ``transformer`` (once; raises if already there)."""
    blocks = transformer.blocks
    if len(blocks) == 0:
        raise ValueError("transformer has no blocks")
    if HookRegistry.check_if_exists_or_initialize(blocks[0]).get_hook(HEAD_HOOK) is not None:
        raise RuntimeError("SRD hooks are already applied to this transformer")
    for i, block in enumerate(blocks):
        registry = HookRegistry.check_if_exists_or_initialize(block)
        # registered last = outermost: the head gathers hidden_states, then the rope hook fixes rotary_emb
        registry.register_hook(_RopeGatherHook(ctx), ROPE_HOOK)
        if i == 0:
            registry.register_hook(_HeadGatherHook(ctx), HEAD_HOOK)
    HookRegistry.check_if_exists_or_initialize(transformer.proj_out).register_hook(
        _TailScatterHook(ctx), TAIL_HOOK
    )
    text_embedder = transformer.condition_embedder.text_embedder
    HookRegistry.check_if_exists_or_initialize(text_embedder).register_hook(_TextCacheHook(ctx), TEXT_HOOK)
    HookRegistry.check_if_exists_or_initialize(transformer.rope).register_hook(
        _RopeCacheHook(), ROPE_CACHE_HOOK
    )
    HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()
    log.debug("SRD hooks applied", extra={"blocks": len(blocks)})


def remove_srd_hooks(transformer: Any) -> None:
    for i, block in enumerate(transformer.blocks):
        registry = HookRegistry.check_if_exists_or_initialize(block)
        if i == 0:
            registry.remove_hook(HEAD_HOOK, recurse=False)
        registry.remove_hook(ROPE_HOOK, recurse=False)
    HookRegistry.check_if_exists_or_initialize(transformer.proj_out).remove_hook(TAIL_HOOK, recurse=False)
    text_embedder = transformer.condition_embedder.text_embedder
    HookRegistry.check_if_exists_or_initialize(text_embedder).remove_hook(TEXT_HOOK, recurse=False)
    HookRegistry.check_if_exists_or_initialize(transformer.rope).remove_hook(ROPE_CACHE_HOOK, recurse=False)
    HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()
