"""Images: ladder's engine against transformers' Idefics3ForConditionalGeneration on the same random weights
of SmolVLM-256M-Instruct's shapes (a SmolLM2-135M text model, a 12-layer SigLIP over 512-pixel tiles, 64
tokens a tile), in one process, alternated round by round; medians of the rounds.

    .venv/bin/python benchmarks/vision_bench.py [--longest-edge 1024] [--rounds 3] [--max-tokens 32]
        [--out benchmarks/results/vision.json]

Each round sends one new random image and the same question, then a second turn of that chat (the image
sent again with the first answer and a new question, as chat clients send it; ladder finds the image's
embeddings in its image cache and the conversation's blocks in its prefix cache). "prep" is the image processor (decode, resize,
tiles), "vision" the tower over the tiles (ladder's own column; transformers' runs inside its first step),
TTFT from the image's bytes to the first token, and the decode rate of the tokens after it (greedy, EOS
ignored). ladder runs its CPU default for a float32 directory (`--quantization auto`: W8A8 text layers;
`--vision-dtype auto`: the tower in bfloat16 on a CPU with bfloat16 matmuls in hardware, else float32) and
float32 throughout (`--quantization none --vision-dtype float32`); transformers runs float32. The model's weights are random, so the text
is noise; the work per token is the real model's.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_report import write_report  # benchmarks/, this script's directory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from tiny_models import make_tiny_vision_model  # the tests' model builder, here at full size

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from model.loader import load

QUESTION = "Describe this image in detail."
# A second turn about the same image: the chat is sent again, image and all, as clients send it.
SECOND_TURN = [{"role": "assistant", "content": [{"type": "text", "text": "A street with trees and a red car."}]},
               {"role": "user", "content": [{"type": "text", "text": "What color are the trees?"}]}]


def conversation(turn: int) -> list[dict]:
    first = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return first if turn == 1 else first + SECOND_TURN
# SmolVLM-256M-Instruct's shapes.
TEXT = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "rope_theta": 100000.0, "max_position_embeddings": 8192}
VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "image_size": 512, "patch_size": 16}


def image_bytes(seed: int, height: int, width: int) -> tuple[bytes, object]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    # Smooth noise (a photo compresses; white noise makes the PNG decode dominate the preprocessing).
    small = rng.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue(), image


def ladder_sides(directory: Path, max_model_len: int) -> dict[str, LLMEngine]:
    """ladder's two sides of a vision model's directory: its CPU default (W8A8 text layers, the tower's dtype by
    `--vision-dtype auto`) and float32 throughout, by name."""
    sides = {}
    for quantization, vision_dtype in (("w8a8", "auto"), ("none", "float32")):
        loaded = load(directory, quantization=quantization, vision_dtype=vision_dtype)
        tower = str(loaded.module.vision.encoder.dtype).removeprefix("torch.")
        name = f"ladder {'w8a8' if quantization == 'w8a8' else 'fp32'}, {tower} tower"
        sides[name] = LLMEngine(EngineConfig(model=str(directory), quantization=loaded.quantization,
                                             max_model_len=max_model_len), loaded=loaded)
    return sides


def ladder_round(engine: LLMEngine, data: bytes, max_tokens: int, request_id: str, turn: int = 1
                 ) -> dict[str, float]:
    vision, tokenizer = engine.vision, engine.tokenizer
    start = time.perf_counter()
    image = vision.processor.process(data)
    _, ids = tokenizer.encode_chat(conversation(turn))
    ids = vision.processor.place(ids, [image], tokenizer)
    prepared = time.perf_counter()
    encoded = engine.encode_images([image])
    encoded_at = time.perf_counter()
    engine.add_request(request_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                       images=encoded)
    first = None
    tokens = 0
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += len(delta.token_ids)
            if first is None and delta.token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"prep_ms": 1e3 * (prepared - start), "vision_ms": 1e3 * (encoded_at - prepared),
            "ttft_ms": 1e3 * (first - start), "decode_tok_s": (tokens - 1) / (end - first),
            "prompt_tokens": len(ids), "tiles": image.pixels.shape[0]}


def transformers_round(model, processor, image, max_tokens: int, text: str) -> dict[str, float]:
    start = time.perf_counter()
    inputs = processor(images=[image], text=text, return_tensors="pt")
    return {**timed_generate(model, inputs, max_tokens, start), "tiles": int(inputs["pixel_values"].shape[1])}


def timed_generate(model, inputs: dict, max_tokens: int, start: float) -> dict[str, float]:
    """transformers' first token and decode on prepared `inputs` (prepared since `start`): a 1-token generate,
    then a `max_tokens` one."""
    prepared = time.perf_counter()
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter()
        model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    end = time.perf_counter()
    # The second call prefills again: its decode time is its whole time less the first call's.
    return {"prep_ms": 1e3 * (prepared - start), "vision_ms": float("nan"), "ttft_ms": 1e3 * (first - start),
            "decode_tok_s": (max_tokens - 1) / ((end - first) - (first - prepared)),
            "prompt_tokens": int(inputs["input_ids"].shape[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--longest-edge", type=int, default=1024,
                        help="images are resized to this longest edge first (SmolVLM-256M's: 2048, 17 tiles "
                             "for a square image; 1024: 5; 512: 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/vision.json")
    args = parser.parse_args()
    from transformers import Idefics3ForConditionalGeneration, Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    workdir = Path(tempfile.mkdtemp(prefix="ladder-vision-"))
    directory = make_tiny_vision_model(workdir / "smolvlm-256m-shapes", longest_edge=args.longest_edge, tile=512,
                                       text=TEXT, vision=VISION, scale_factor=4)
    sides = ladder_sides(directory, 4096)
    ip = Idefics3ImageProcessorPil(size={"longest_edge": args.longest_edge}, max_image_size={"longest_edge": 512})
    processor = Idefics3Processor(ip, tokenizer=PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json")),
                                  image_seq_len=64)
    reference = Idefics3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    # Warm-up: the first image pays one-time costs on every side.
    warm, warm_image = image_bytes(0, 600, 800)
    for engine in sides.values():
        ladder_round(engine, warm, 2, "warm")
    texts = {turn: next(iter(sides.values())).tokenizer.apply_chat_template(conversation(turn)) for turn in (1, 2)}
    transformers_round(reference, processor, warm_image, 2, texts[1])
    names = [f"{name}{suffix}" for suffix in ("", ", turn 2") for name in (*sides, "transformers fp32")]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        data, image = image_bytes(r + 1, 600, 800)
        for turn, suffix in ((1, ""), (2, ", turn 2")):  # turn 2: the same image again, the chat one turn on
            for name, engine in sides.items():
                results[name + suffix].append(ladder_round(engine, data, args.max_tokens, f"r{r}t{turn}", turn))
            results["transformers fp32" + suffix].append(
                transformers_round(reference, processor, image, args.max_tokens, texts[turn]))
    write_report(args.out, table(results), longest_edge=args.longest_edge, rounds=args.rounds,
                 max_tokens=args.max_tokens)


def table(results: dict[str, list[dict[str, float]]]) -> list[dict]:
    """Each side's medians over its rounds and its ratios to transformers' in the same turn, printed as a table;
    the rows. Sides are named "<side>" for a first turn and "<side>, turn 2" for a second."""
    rows = []
    print(f"{'side':38} {'tiles':>5} {'prompt':>6} {'prep ms':>8} {'vision ms':>9} {'TTFT ms':>8} {'x':>5} "
          f"{'decode tok/s':>12} {'x':>5}")
    for name, runs in results.items():
        base = results["transformers fp32" + (", turn 2" if name.endswith("turn 2") else "")]
        row = {"side": name, **{k: statistics.median(x[k] for x in runs) for k in runs[0]}}
        row["ttft_x"] = statistics.median(x["ttft_ms"] for x in base) / row["ttft_ms"]
        row["decode_x"] = row["decode_tok_s"] / statistics.median(x["decode_tok_s"] for x in base)
        rows.append(row)
        print(f"{name:38} {row['tiles']:5.0f} {row['prompt_tokens']:6.0f} {row['prep_ms']:8.1f} "
              f"{row['vision_ms']:9.1f} {row['ttft_ms']:8.1f} {row['ttft_x']:5.2f} {row['decode_tok_s']:12.1f} "
              f"{row['decode_x']:5.2f}")
    return rows


if __name__ == "__main__":
    main()
