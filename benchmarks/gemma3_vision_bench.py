"""Gemma 3 with images: ladder's engine against transformers' Gemma3ForConditionalGeneration on the same random
weights, in one process, alternated round by round; medians of the rounds.

    .venv/bin/python benchmarks/gemma3_vision_bench.py [--vision-layers 8] [--rounds 3] [--max-tokens 32]
        [--out benchmarks/results/gemma3_vision.json]

Shapes: Gemma 3 1B's decoder (26 layers, 1152 wide, sliding-window layers five to one full) with SmolLM2's
49k vocabulary (the tests' tokenizer, not Gemma's 262k), and Gemma 3's SigLIP tower at its own width over its
896-pixel image (4,096 patches pooled to 256 tokens) but `--vision-layers` of its 27 layers, so that
transformers' float32 rounds end in minutes on two cores (the tower's time scales with its layers).

Each round sends one new random image and the same question, then a second turn of that chat (the image sent
again with the first answer and a new question; ladder finds its embeddings in the image cache and the
conversation's blocks in the prefix cache). "prep" is the image processor and the prompt's ids, "vision"
the tower (ladder's own column; transformers' runs inside its first step), TTFT from the image's bytes to the
first token, decode the rate of the tokens after it (greedy, EOS ignored). ladder runs its CPU default for a
float32 directory (W8A8 text layers, `--vision-dtype auto`) and float32 throughout; transformers float32, its
image tokens marked (`token_type_ids`) as its processor marks them. The text is noise; the work is the model's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_report import write_report  # benchmarks/, this script's directory
from vision_bench import conversation, image_bytes, ladder_round, ladder_sides, table, timed_generate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
import tiny_models  # the tests' model builder, here at larger shapes

from engine.llm_engine import LLMEngine

# Gemma 3 1B's decoder.
TEXT = {"hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "max_position_embeddings": 32_768,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2}
# Gemma 3's SigLIP (so400m at 896 pixels), layers set by --vision-layers.
VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_attention_heads": 16, "image_size": 896,
          "patch_size": 14}


def build(directory: Path, vision_layers: int) -> Path:
    """The tests' tiny Gemma 3 builder at these shapes."""
    import json

    import transformers

    tiny_models.make_tiny_gemma3_vision_model(directory, image_size=896, tokens_per_image=256)
    config = json.loads((directory / "config.json").read_text())
    config["text_config"].update(TEXT)
    config["vision_config"].update({**VISION, "num_hidden_layers": vision_layers, "patch_size": 14})
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def reference_inputs(engine: LLMEngine, image_processor, tokenizer, image, turn: int) -> dict:
    """transformers' inputs: its processor's pixels, the rendered chat with each <start_of_image> replaced in the
    text, and the image tokens marked."""
    text = engine.tokenizer.apply_chat_template(conversation(turn))
    full = f"\n\n<start_of_image>{'<image_soft_token>' * 256}<end_of_image>\n\n"
    ids = torch.tensor([tokenizer(text.replace("<start_of_image>", full), add_special_tokens=False)["input_ids"]])
    pixels = image_processor(images=[image], return_tensors="pt")["pixel_values"]
    return {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids),
            "token_type_ids": (ids == engine.vision.image_token_id).long()}


def transformers_round(model, engine, image_processor, tokenizer, image, max_tokens: int, turn: int) -> dict:
    start = time.perf_counter()
    inputs = reference_inputs(engine, image_processor, tokenizer, image, turn)
    return {**timed_generate(model, inputs, max_tokens, start), "tiles": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vision-layers", type=int, default=8, help="of Gemma 3's 27 SigLIP layers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/gemma3_vision.json")
    args = parser.parse_args()
    from transformers import Gemma3ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    directory = build(Path(tempfile.mkdtemp(prefix="ladder-gemma3-vision-")) / "gemma3", args.vision_layers)
    sides = ladder_sides(directory, 2048)
    any_engine = next(iter(sides.values()))
    image_processor = Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, do_convert_rgb=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    reference = Gemma3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    warm, warm_image = image_bytes(0, 600, 800)  # the first image pays one-time costs on every side
    for engine in sides.values():
        ladder_round(engine, warm, 2, "warm")
    transformers_round(reference, any_engine, image_processor, tokenizer, warm_image, 2, 1)
    names = [f"{name}{suffix}" for suffix in ("", ", turn 2") for name in (*sides, "transformers fp32")]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        data, image = image_bytes(r + 1, 600, 800)
        for turn, suffix in ((1, ""), (2, ", turn 2")):
            for name, engine in sides.items():
                results[name + suffix].append(ladder_round(engine, data, args.max_tokens, f"r{r}t{turn}", turn))
            results["transformers fp32" + suffix].append(
                transformers_round(reference, any_engine, image_processor, tokenizer, image, args.max_tokens, turn))
    write_report(args.out, table(results), vision_layers=args.vision_layers, rounds=args.rounds,
                 max_tokens=args.max_tokens, text_shapes="Gemma 3 1B decoder, SmolLM2 vocabulary")


if __name__ == "__main__":
    main()
