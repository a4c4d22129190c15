"""A plain denoising loop written the way diffusers' WanPipeline writes it (sequential CFG branches)."""

from __future__ import annotations

from typing import Any

import torch

from producer.contract import GenerationRequest
from workers.engine import ModelBundle


@torch.no_grad()
def reference_denoise(bundle: ModelBundle, request: GenerationRequest) -> list[torch.Tensor]:
    """Latents after every step, (1, C, F, H, W) each."""
    cond = bundle.encode_prompt(request.prompt).embeddings
    cfg = request.guidance_scale > 1.0
    uncond = bundle.encode_prompt(request.negative_prompt or "").embeddings if cfg else None
    # diffusers' schedulers and models are only loosely typed; the loop uses their runtime API.
    scheduler: Any = bundle.make_scheduler()
    transformer: Any = bundle.transformer
    scheduler.set_timesteps(request.num_steps, device=bundle.device)
    scheduler.set_begin_index(0)
    shape = bundle.latent_shape(request.num_frames, request.height, request.width)
    x = torch.randn(
        (1, *shape), generator=torch.Generator("cpu").manual_seed(request.seed), dtype=torch.float32
    )
    out = []
    for t in scheduler.timesteps:
        v = transformer(
            hidden_states=x.to(bundle.dtype),
            timestep=t.expand(1),
            encoder_hidden_states=cond,
            return_dict=False,
        )[0].float()
        if uncond is not None:
            u = transformer(
                hidden_states=x.to(bundle.dtype),
                timestep=t.expand(1),
                encoder_hidden_states=uncond,
                return_dict=False,
            )[0].float()
            v = u + request.guidance_scale * (v - u)
        x = scheduler.step(v, t, x, return_dict=False)[0]
        out.append(x)
    return out
