"""A random-weight Wan2.1 diffusers directory assembled from small configs (no download).

``build_random_wan_dir(path)`` writes it with ``WanPipeline.save_pretrained`` (the layout of the real
Wan2.1-T2V-1.3B diffusers repository) and returns the in-memory pipeline it saved.
"""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = [
    "a",
    "an",
    "the",
    "red",
    "blue",
    "green",
    "yellow",
    "white",
    "black",
    "circle",
    "square",
    "triangle",
    "cat",
    "dog",
    "moving",
    "left",
    "right",
    "up",
    "down",
    "on",
    "of",
    "background",
]


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def build_random_wan_dir(path: Path, *, seed: int = 0):
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline
    from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=64,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    pipe.save_pretrained(path)
    for module in (text_encoder, transformer, vae):
        module.eval()  # freshly built modules are in training mode (dropout)
    return pipe
