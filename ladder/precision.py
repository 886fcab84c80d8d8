"""The `--dtype`, `--quantization` and `--kv-cache-dtype` options of serve, generate, bench and doctor
(model/precision.py names them)."""

from __future__ import annotations

import argparse

from model.precision import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES, QUANTIZATIONS, VISION_DTYPE_CHOICES


def add_dtype_argument(p: argparse.ArgumentParser, name: str = "--dtype", default: str | None = "float32",
                       help: str = "the weights' float type (default float32)") -> None:
    p.add_argument(name, default=default, choices=DTYPE_CHOICES, help=help)


def add_auto_dtype_argument(p: argparse.ArgumentParser) -> None:
    """`--dtype` defaulting to auto, resolved by model/precision.py `resolve_dtype` (serve, generate, bench)."""
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_CHOICES),
                   help="the weights' float type; auto (default): bfloat16 on CUDA (float16 on a GPU without "
                        "bfloat16), float32 on a CPU whatever the checkpoint holds (--quantization auto starts "
                        "from float32 there)")


def add_quantization_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default="auto", choices=["auto", *QUANTIZATIONS],
                   help="int8 linears applied at load, no compile step: int8 (weight-only), w8a8 (int8 weights "
                        "and activations, SmoothQuant calibrated once and cached), w4a8 (a Q4_0/Q4_1/Q8_0 GGUF's "
                        "own blocks times int8 activations: fastest for one stream, slower for large batches), "
                        "none (the weights' dtype). auto (default), on a CPU with float32 weights: w4a8 for a "
                        "Q4_0/Q4_1/Q8_0 GGUF in one process, else w8a8; none for 16-bit weights, a GPU or a CPU "
                        "without AVX-512 VNNI")


def add_mmproj_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mmproj", default=None, metavar="GGUF",
                   help="llama.cpp's multimodal projector file for a GGUF text model (SmolVLM's or Gemma 3's "
                        "mmproj-*.gguf): the model then reads images")


def add_pan_and_scan_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pan-and-scan", action=argparse.BooleanOptionalAction, default=None,
                   help="Gemma 3: also show a wide or tall image's crops, each as an image of its own (256 tokens "
                        "each; default: as the checkpoint's preprocessor_config.json says, off in Google's)")


def add_vision_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vision-dtype", default="auto", choices=VISION_DTYPE_CHOICES,
                   help="a vision model's image tower: auto (default) runs it in the model's dtype, but in "
                        "bfloat16 for a float32 model on a CPU with bfloat16 matmuls in hardware (AMX, "
                        "AVX-512 BF16): 3x faster there; float32 for embeddings exactly as the checkpoint's")


def add_kv_cache_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="the KV cache's element type; auto (default): the activations' (float32 on a CPU, "
                        "quantized or not). bfloat16 or float16 halve the cache's memory (twice the tokens in "
                        "--kv-cache-memory) and what decode attention reads; keys and values are rounded once "
                        "as they are written, attention computes in float32. float16 keeps 3 more bits of each "
                        "value, bfloat16 float32's range")
