"""A tiny random-weight Stable Diffusion pipeline in diffusers layout, for tests.

:func:`write_tiny_pipeline` builds a UNet, a VAE with Stable Diffusion's 8x latent scale, a CLIP text encoder with
a byte-level vocabulary of a few hundred tokens and an Euler scheduler, then saves them as a diffusers repo would
hold them (``model_index.json`` and one folder per component, safetensors weights). It takes well under a second
and a few MB; a 64x64 image in 4 steps takes about a second on a CPU core. Output is noise: the point is that text-
to-image, image-to-image and inpainting run for real. Weights come from ``torch.manual_seed(seed)``, so a seed
always writes the same pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["TINY_SIZE", "write_tiny_pipeline"]

#: the tiny pipeline's default image side (``sample_size`` x the VAE's scale factor 8)
TINY_SIZE = 64
_LATENT = TINY_SIZE // 8
_TEXT_DIM = 32
_MAX_TOKENS = 77


def _bytes_to_unicode() -> list[str]:
    """CLIP's byte-level alphabet: one printable character per byte value (as its tokenizer maps them)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _write_tokenizer(folder: Path) -> int:
    """A CLIP BPE tokenizer with no merges: every character is a token. Returns the vocabulary size."""
    folder.mkdir(parents=True, exist_ok=True)
    alphabet = _bytes_to_unicode()
    tokens = [*alphabet, *(c + "</w>" for c in alphabet), "<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(tokens)}
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": _MAX_TOKENS,
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "do_lower_case": True,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return len(vocab)


def write_tiny_pipeline(directory: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random Stable Diffusion pipeline in diffusers layout.

    Args:
        directory: The folder to write (created; existing files of the same names are replaced).
        seed: Seeds the random weights: the same seed writes the same pipeline.

    Returns:
        The folder, ready for ``DiffusionPipeline.from_pretrained`` or a model row's local checkpoint.
    """
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(out / "tokenizer")
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=_LATENT,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=_TEXT_DIM,
        attention_head_dim=8,
        norm_num_groups=16,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 16, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=TINY_SIZE,
    )
    text_config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=_TEXT_DIM,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_MAX_TOKENS,
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )
    text_encoder = CLIPTextModel(text_config)
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", timestep_spacing="trailing", steps_offset=1
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=CLIPTokenizer.from_pretrained(out / "tokenizer"),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out, safe_serialization=True)  # type: ignore[attr-defined]
    return out
