"""Model registry: a catalog name → a ``ModelBundle`` the engine can run.

``load_bundle(name, device=..., dtype=..., wan21_dir=..., toy_weights_dir=...)`` knows every name in
``producer.catalog.CATALOG``:

- ``tiny-random-wan``: a small ``WanTransformer3DModel`` built from a config with a fixed seed, a hashed-word
  text embedding and a fixed projection latent → RGB as its "VAE" (4× spatial, no temporal compression).
- ``wan2.1-t2v-1.3b``: diffusers Wan2.1 components (``WanTransformer3DModel``, ``AutoencoderKLWan``, the UMT5
  text encoder + tokenizer and the scheduler) from a local diffusers directory (``WorkerSettings.wan21_dir``);
  everything is loaded with ``local_files_only`` — nothing is ever downloaded.
- ``toy``: ``workers.toy.model.load_toy_bundle(device, dtype, weights_dir)``, imported when first asked for.

``build_random_wan_bundle`` builds a random-weight bundle of any size (the benchmark's mid-size config uses it).
"""

from __future__ import annotations

import hashlib
import html
import importlib
import json
import logging
import re
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from producer.catalog import CATALOG, ModelSpec
from workers.engine.bundle import ModelBundle, TextEncoding
from workers.engine.errors import ModelUnavailable

log = logging.getLogger(__name__)

DeviceLike = str | torch.device
DTypeLike = str | torch.dtype

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: DTypeLike) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(_DTYPES)})") from None


# --- random Wan-architecture models ---------------------------------------------------------------------


@dataclass(frozen=True)
class RandomWanConfig:
    """A Wan-architecture transformer with random weights plus deterministic text and "VAE" stand-ins."""

    heads: int = 4
    head_dim: int = 16
    layers: int = 2
    ffn_dim: int = 128
    text_dim: int = 32
    text_len: int = 16
    freq_dim: int = 32
    latent_channels: int = 4
    spatial_factor: int = 4
    patch: tuple[int, int, int] = (1, 2, 2)
    vocab: int = 512
    seed: int = 0

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


TINY_CONFIG = RandomWanConfig()
# Wan2.1-1.3B width (12 heads × 128, ffn 8960, UMT5 4096-d text, 512 text tokens, 16 latent channels, 8× VAE),
# with only a few blocks so that it runs on a CPU.
MID_CONFIG = RandomWanConfig(
    heads=12,
    head_dim=128,
    layers=2,
    ffn_dim=8960,
    text_dim=4096,
    text_len=512,
    freq_dim=256,
    latent_channels=16,
    spatial_factor=8,
    vocab=1024,
)


def _cast_keeping_fp32(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast to ``dtype`` except the modules diffusers keeps in float32 (``_keep_in_fp32_modules``)."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, module in model.named_modules():
        if any(part in keep for part in name.split(".")):
            continue
        for pname, param in module.named_parameters(recurse=False):
            setattr(module, pname, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))
        for bname, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point():
                module.register_buffer(
                    bname, buf.to(dtype), persistent=bname not in module._non_persistent_buffers_set
                )


_WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


def build_random_wan_bundle(
    config: RandomWanConfig,
    *,
    spec: ModelSpec,
    device: DeviceLike = "cpu",
    dtype: DTypeLike = "float32",
    name: str = "random-wan",
) -> ModelBundle:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    dev = torch.device(device)
    dt = resolve_dtype(dtype)
    cpu_rng = torch.Generator("cpu").manual_seed(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        transformer: Any = WanTransformer3DModel(
            patch_size=config.patch,
            num_attention_heads=config.heads,
            attention_head_dim=config.head_dim,
            in_channels=config.latent_channels,
            out_channels=config.latent_channels,
            text_dim=config.text_dim,
            freq_dim=config.freq_dim,
            ffn_dim=config.ffn_dim,
            num_layers=config.layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        )
    transformer.eval().requires_grad_(False).to(dev)
    if dt != torch.float32:
        _cast_keeping_fp32(transformer, dt)

    table = torch.randn(config.vocab, config.text_dim, generator=cpu_rng)
    sf = config.spatial_factor
    proj = torch.randn(3 * sf * sf, config.latent_channels, generator=cpu_rng) / config.latent_channels**0.5

    def encode_prompt(prompt: str) -> TextEncoding:
        all_words = _WORD.findall(prompt.lower())
        words = all_words[: config.text_len - 1]
        ids = [3 + zlib.crc32(w.encode()) % (config.vocab - 3) for w in words] + [1]
        tokens = [*words, "</s>"]
        n = len(ids)
        pad = config.text_len - n
        emb = torch.zeros(1, config.text_len, config.text_dim)
        emb[0, :n] = table[torch.tensor(ids)]
        return TextEncoding(
            embeddings=emb.to(dev, dt),
            token_ids=ids + [0] * pad,
            tokens=tokens + ["<pad>"] * pad,
            valid=[True] * n + [False] * pad,
            prompt_tokens=len(all_words) + 1,
        )

    def latent_shape(num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        step = sf * config.patch[1]
        if height % step or width % step:
            raise ValueError(f"height and width must be multiples of {step}")
        return (config.latent_channels, num_frames, height // sf, width // sf)

    def decode(latent: torch.Tensor) -> np.ndarray:
        z = latent[0].detach().to("cpu", torch.float32)  # (C, F, h, w)
        _, f, h, w = z.shape
        rgb = torch.einsum("oc,cfhw->fhwo", proj, z).reshape(f, h, w, 3, sf, sf)
        rgb = torch.sigmoid(rgb).permute(0, 1, 4, 2, 5, 3).reshape(f, h * sf, w * sf, 3)
        return (rgb * 255.0).round().clamp(0, 255).to(torch.uint8).numpy()

    return ModelBundle(
        spec=spec,
        transformer=transformer,
        make_scheduler=lambda: cast(Any, FlowMatchEulerDiscreteScheduler(shift=1.0)),
        encode_prompt=encode_prompt,
        latent_shape=latent_shape,
        decode=decode,
        weights_id=f"{name}:seed{config.seed}:{config.fingerprint()[:16]}",
        device=dev,
        dtype=dt,
    )


def _load_tiny(device: DeviceLike, dtype: DTypeLike, **_: Any) -> ModelBundle:
    return build_random_wan_bundle(
        TINY_CONFIG, spec=CATALOG["tiny-random-wan"], device=device, dtype=dtype, name="tiny-random-wan"
    )


# --- Wan2.1 from a local diffusers directory ----------------------------------------------------------------


def _prompt_clean(text: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text))).strip()


def _weights_fingerprint(directory: Path) -> str:
    """sha256 over the transformer's config and, per weight file, its size and first/last MiB (whole if small)."""
    h = hashlib.sha256()
    config = directory / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for path in sorted(directory.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as fh:
            if size <= 64 << 20:
                h.update(fh.read())
            else:
                h.update(fh.read(1 << 20))
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
    return h.hexdigest()


def _load_diffusers_model(cls: Any, folder: Path) -> Any:
    """Build ``cls`` from ``folder/config.json`` and load its safetensors weights (single file or sharded).

    diffusers' ``from_pretrained`` refuses models with ``_keep_in_fp32_modules`` (the Wan transformer) unless
    ``accelerate`` is installed; reading the state dict directly needs nothing beyond safetensors.
    """
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelUnavailable(f"{folder} holds no .safetensors weights")
    model = cls.from_config(cls.load_config(folder))
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path))
    ignore = tuple(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ())
    missing, unexpected = model.load_state_dict(state, strict=False)
    unexpected = [k for k in unexpected if not any(pat in k for pat in ignore)]
    if missing or unexpected:
        raise ModelUnavailable(
            f"{folder}: weights do not match {cls.__name__} (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    return model.eval().requires_grad_(False)


def load_wan21_dir(
    directory: Path,
    *,
    spec: ModelSpec,
    device: DeviceLike = "cpu",
    dtype: DTypeLike = "float32",
    max_sequence_length: int = 512,
) -> ModelBundle:
    """Load Wan2.1 components from a local diffusers directory (as written by ``WanPipeline.save_pretrained``)."""
    import diffusers
    import transformers
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    directory = Path(directory)
    for sub in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        if not (directory / sub).is_dir():
            raise ModelUnavailable(f"{directory} is not a Wan2.1 diffusers directory: '{sub}/' is missing")
    dev = torch.device(device)
    dt = resolve_dtype(dtype)
    index = (
        json.loads((directory / "model_index.json").read_text())
        if (directory / "model_index.json").exists()
        else {}
    )

    transformer = _load_diffusers_model(WanTransformer3DModel, directory / "transformer")
    if dt != torch.float32:
        _cast_keeping_fp32(transformer, dt)
    transformer.to(dev)
    # The VAE decodes in float32 as in diffusers' Wan examples.
    vae = _load_diffusers_model(AutoencoderKLWan, directory / "vae").to(dev)
    te_class_name = (index.get("text_encoder") or ["transformers", "UMT5EncoderModel"])[1]
    te_class = getattr(transformers, te_class_name)
    text_encoder = te_class.from_pretrained(directory / "text_encoder", dtype=dt, local_files_only=True)
    text_encoder.eval().requires_grad_(False).to(dev)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory / "tokenizer", local_files_only=True)
    sched_config = json.loads((directory / "scheduler" / "scheduler_config.json").read_text())
    sched_class = getattr(diffusers, sched_config.get("_class_name", "UniPCMultistepScheduler"))

    def make_scheduler() -> Any:
        return sched_class.from_config(sched_config)

    @torch.no_grad()
    def encode_prompt(prompt: str) -> TextEncoding:
        inputs = tokenizer(
            [_prompt_clean(prompt)],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = inputs.input_ids, inputs.attention_mask
        n = int(mask.gt(0).sum())
        whole = (
            len(tokenizer(_prompt_clean(prompt), add_special_tokens=True).input_ids)
            if n == ids.shape[1]
            else n
        )
        hidden = text_encoder(ids.to(dev), mask.to(dev)).last_hidden_state.to(dt)
        emb = torch.zeros_like(hidden)
        emb[:, :n] = hidden[:, :n]
        id_list = [int(i) for i in ids[0]]
        return TextEncoding(
            embeddings=emb,
            token_ids=id_list,
            tokens=[str(t) for t in tokenizer.convert_ids_to_tokens(id_list)],
            valid=[bool(m) for m in mask[0].gt(0)],
            prompt_tokens=whole,
        )

    tf = int(vae.config.scale_factor_temporal or 4)
    sf = int(vae.config.scale_factor_spatial or 8)
    z_dim = int(vae.config.z_dim)
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, z_dim, 1, 1, 1).to(dev)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, z_dim, 1, 1, 1).to(dev)

    def latent_shape(num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        return (z_dim, (num_frames - 1) // tf + 1, height // sf, width // sf)

    @torch.no_grad()
    def decode(latent: torch.Tensor) -> np.ndarray:
        z = latent.to(dev, torch.float32) / inv_std + mean
        video = vae.decode(z, return_dict=False)[0]  # (1, 3, F, H, W) in [-1, 1]
        video = (video[0].float() / 2 + 0.5).clamp(0, 1).permute(1, 2, 3, 0)
        return (video * 255.0).round().to(torch.uint8).cpu().numpy()

    return ModelBundle(
        spec=spec,
        transformer=transformer,
        make_scheduler=make_scheduler,
        encode_prompt=encode_prompt,
        latent_shape=latent_shape,
        decode=decode,
        weights_id="wan21:" + _weights_fingerprint(directory / "transformer")[:32],
        device=dev,
        dtype=dt,
        fps=16,
    )


def _wan21_directory(wan21_dir: Path | None) -> Path:
    if wan21_dir is None:
        raise ModelUnavailable(
            "wan2.1-t2v-1.3b needs a local diffusers directory: set CHORUS_WAN21_DIR (weights are never downloaded)"
        )
    if not Path(wan21_dir).is_dir():
        raise ModelUnavailable(f"wan2.1-t2v-1.3b directory {wan21_dir} does not exist")
    return Path(wan21_dir)


def _load_wan21(device: DeviceLike, dtype: DTypeLike, wan21_dir: Path | None = None, **_: Any) -> ModelBundle:
    directory = _wan21_directory(wan21_dir)
    return load_wan21_dir(directory, spec=CATALOG["wan2.1-t2v-1.3b"], device=device, dtype=dtype)


# --- the toy model (another package) ----------------------------------------------------------------------


def _load_toy(
    device: DeviceLike, dtype: DTypeLike, toy_weights_dir: Path | None = None, **_: Any
) -> ModelBundle:
    try:
        module = importlib.import_module("workers.toy.model")
    except ModuleNotFoundError as exc:
        if exc.name not in ("workers.toy.model", "workers.toy"):
            raise
        raise ModelUnavailable(
            "the toy model is not available: workers.toy.model is not built yet (see the [toy-model] issue)"
        ) from None
    loader = getattr(module, "load_toy_bundle", None)
    if loader is None:
        raise ModelUnavailable("workers.toy.model has no load_toy_bundle(device, dtype, weights_dir)")
    try:
        bundle = loader(torch.device(device), resolve_dtype(dtype), toy_weights_dir)
    except FileNotFoundError as exc:
        raise ModelUnavailable(
            f"the toy model's weights are missing ({exc}); set CHORUS_TOY_WEIGHTS_DIR"
        ) from exc
    if not isinstance(bundle, ModelBundle):
        raise ModelUnavailable(f"load_toy_bundle returned {type(bundle).__name__}, not a ModelBundle")
    return bundle


Loader = Callable[..., ModelBundle]

LOADERS: dict[str, Loader] = {
    "tiny-random-wan": _load_tiny,
    "wan2.1-t2v-1.3b": _load_wan21,
    "toy": _load_toy,
}


def load_bundle(
    name: str,
    *,
    device: DeviceLike = "cpu",
    dtype: DTypeLike = "float32",
    wan21_dir: Path | None = None,
    toy_weights_dir: Path | None = None,
) -> ModelBundle:
    """Load the model registered under ``name`` (a ``producer.catalog`` name). Raises ``ModelUnavailable``."""
    loader = _loader(name)
    log.info("loading model", extra={"model": name, "device": str(device), "dtype": str(dtype)})
    return loader(usable_device(device), dtype, wan21_dir=wan21_dir, toy_weights_dir=toy_weights_dir)


def _loader(name: str) -> Loader:
    loader = LOADERS.get(name)
    if loader is None:
        raise ModelUnavailable(f"unknown model {name!r} (known: {', '.join(sorted(LOADERS))})")
    return loader


def check_available(
    name: str,
    *,
    device: DeviceLike,
    wan21_dir: Path | None = None,
    toy_weights_dir: Path | None = None,
    count_gpus: bool = True,
) -> None:
    """Raise ``ModelUnavailable`` for what ``load_bundle`` would refuse before reading any weights: an unknown
    name, a device this process cannot use, a Wan2.1 directory or toy weight files that are not there. A worker
    checks its models with this before it announces them, so orders for a model it cannot load are not sent to it."""
    _loader(name)
    usable_device(device, count_gpus=count_gpus)
    if name == "wan2.1-t2v-1.3b":
        _wan21_directory(wan21_dir)
    if name == "toy":
        _toy_weight_files(toy_weights_dir)


def _toy_weight_files(directory: Path | None) -> None:
    from workers.toy.model import CONFIG_FILE, WEIGHTS_DIR, WEIGHTS_FILE

    folder = Path(directory) if directory is not None else WEIGHTS_DIR
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / f).is_file()]
    if missing:
        raise ModelUnavailable(
            f"the toy model's weights are missing ({folder} has no {' or '.join(missing)}); set "
            "CHORUS_TOY_WEIGHTS_DIR to a folder that has them, or train them (`chorus train-toy --install`)"
        )


def usable_device(device: DeviceLike, *, count_gpus: bool = True) -> torch.device:
    """``device`` as a torch device this process can run on. Raises ``ModelUnavailable`` saying why not, before
    any weights load (torch would fail later, deep in a loader, with an assertion about its build).

    ``count_gpus=False`` checks only that torch was built for the device: a process that forks its CUDA workers
    afterwards (the worker's prefork pool) must not start CUDA, and counting GPUs may start it (torch asks NVML
    first, and falls back to the CUDA runtime when NVML fails)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelUnavailable(
            f"device {str(device)!r} is not a torch device; use e.g. cpu, cuda or cuda:1 (CHORUS_DEVICE)"
        ) from None
    if dev.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise ModelUnavailable(
                f"device {str(device)!r}: this torch is built without CUDA; use cpu (CHORUS_DEVICE)"
            )
        count = torch.cuda.device_count() if count_gpus else None
        if count is not None and (count == 0 or (dev.index or 0) >= count):
            raise ModelUnavailable(
                f"device {str(device)!r}: {count} CUDA device(s) visible here; use another (CHORUS_DEVICE)"
            )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ModelUnavailable(f"device {str(device)!r}: no Apple GPU here; use cpu (CHORUS_DEVICE)")
    return dev
