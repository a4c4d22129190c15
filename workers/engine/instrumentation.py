"""The engine's hooks on a diffusers transformer: SRD hooks on the blocks and Chorus' cross-attention processors.

Installed once per transformer (the state lives on the transformer itself), so that several engines or the
cache-dit benchmark wrapper share one set of hooks instead of stacking them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.engine.srd import SRDContext, apply_srd_hooks, remove_srd_hooks
from workers.engine.text_side import TextRows
from workers.engine.tgaa import CrossAttnState, install_cross_attn_processors, restore_processors


@dataclass
class Instrumentation:
    srd: SRDContext
    attn: CrossAttnState
    previous_processors: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.srd.deactivate()
        self.srd.clear_text_cache()
        self.attn.clear_amplification()
        self.attn.stop_maps()
        self.attn.clear_kv_cache()
        self.srd.text_rows.end()


_ATTR = "_chorus_instrumentation"


def instrument(transformer: Any) -> Instrumentation:
    """Install SRD hooks and cross-attention processors on ``transformer`` once; later calls reuse them."""
    existing = getattr(transformer, _ATTR, None)
    if isinstance(existing, Instrumentation):
        return existing
    rows = (
        TextRows()
    )  # one per transformer: the text hook and the attn2 processors see the same request's rows
    inst = Instrumentation(SRDContext(text_rows=rows), CrossAttnState(text_rows=rows))
    apply_srd_hooks(transformer, inst.srd)
    inst.previous_processors = install_cross_attn_processors(transformer, inst.attn)
    setattr(transformer, _ATTR, inst)
    return inst


def uninstrument(transformer: Any) -> None:
    inst = getattr(transformer, _ATTR, None)
    if not isinstance(inst, Instrumentation):
        return
    inst.reset()
    remove_srd_hooks(transformer)
    restore_processors(transformer, inst.previous_processors)
    delattr(transformer, _ATTR)
