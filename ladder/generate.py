"""`ladder generate`: one prompt, streamed to the terminal, then one line of figures."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from engine.config import resolve_device
from engine.llm import template_message
from ladder.device import add_device_argument
from ladder.precision import (
    add_auto_dtype_argument,
    add_mmproj_argument,
    add_pan_and_scan_argument,
    add_quantization_argument,
    add_vision_dtype_argument,
)
from ladder.tensor_parallel import add_tensor_parallel_argument
from model.chat_template import reads_content_parts
from model.default import DEFAULT_MODEL_NAME
from model.detokenizer import IncrementalDetokenizer
from model.generator import Generator
from model.loader import load
from model.precision import resolve_dtype
from model.quantization import resolve_quantization
from parallel import tensor_parallel_model


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="generate a completion for one prompt",
                            description="Generate a completion for one prompt and stream it to stdout.")
    p.add_argument("prompt", help="the prompt (a user message unless --raw)")
    p.add_argument("--model", default=None,
                   help=f"Hugging Face model directory or GGUF file (default: embedded {DEFAULT_MODEL_NAME})")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling when temperature > 0")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="a system message for the chat template")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image file shown before the prompt (a vision model; repeat for more)")
    add_vision_dtype_argument(p)
    add_mmproj_argument(p)
    add_pan_and_scan_argument(p)
    add_auto_dtype_argument(p)
    add_device_argument(p)
    add_quantization_argument(p)
    add_tensor_parallel_argument(p)
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="a LoRA adapter to run the model with: a PEFT directory or a GGUF adapter")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if not 0.0 <= args.temperature <= 2.0:
        raise ValueError(f"--temperature must be in [0, 2], got {args.temperature}")
    if not args.prompt.strip():
        raise ValueError("the prompt is empty")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    loaded = load(args.model, dtype=dtype, device=device,
                  quantization=resolve_quantization(args.quantization, dtype, device, args.model,
                                                    args.tensor_parallel_size), vision_dtype=args.vision_dtype,
                  mmproj=args.mmproj, pan_and_scan=args.pan_and_scan)
    if args.lora is not None:
        if args.tensor_parallel_size != 1:
            raise ValueError("--lora runs in one process (--tensor-parallel-size 1)")
        from model.lora import load_adapter
        from model.lora_slots import LoRASlots

        adapter = load_adapter(args.lora, loaded.config)
        LoRASlots.with_one(loaded.module, adapter)
        loaded.name = f"{loaded.name} + {adapter.name}"
    if args.tensor_parallel_size != 1:
        # One sequence: split by sequences, one rank would run all its attention.
        attention = "heads" if args.tensor_parallel_attention == "auto" else args.tensor_parallel_attention
        loaded = tensor_parallel_model.start(loaded, args.tensor_parallel_size, attention=attention)
    try:
        return stream(args, loaded)
    finally:
        loaded.module.close()  # a tensor-parallel model's workers; nothing for one process


def stream(args: argparse.Namespace, loaded) -> int:
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ValueError(f"{loaded.path}: no tokenizer.json, so text prompts cannot be encoded")
    vision = getattr(loaded.module, "vision", None)
    encoded = None
    if args.raw:
        if args.image:
            raise ValueError("--image needs the chat template (drop --raw)")
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        if args.image and vision is None:
            raise ValueError(f"{loaded.name} takes no images (--image needs a vision model)")
        parts = vision is not None and reads_content_parts(tokenizer.chat_template or "")
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": [*({"type": "image", "image": read_image(path)}
                                                       for path in args.image), {"type": "text", "text": args.prompt}]})
        sources: list[bytes] = []
        messages = [template_message(m, parts, sources) for m in messages]  # as LLM.chat shows them
        # The template writes the special tokens itself; encoding must not add a second BOS.
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        if args.image:
            images = [vision.processor.process(data) for data in sources]
            prompt_ids = vision.processor.place(prompt_ids, images, tokenizer)
            encoded = vision.encode(images)
    context = loaded.config.max_position_embeddings
    if len(prompt_ids) + args.max_tokens > context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) plus --max-tokens ({args.max_tokens}) exceeds the "
            f"model's context of {context} tokens"
        )
    generator = Generator(loaded.module, len(prompt_ids) + args.max_tokens)
    detokenizer = IncrementalDetokenizer(tokenizer)
    start = time.perf_counter()
    first_token_at = None
    num_output = 0
    for step in generator.generate(prompt_ids, args.max_tokens, args.temperature, args.seed,
                                   tokenizer.stop_token_ids, encoded,
                                   vision if encoded is not None else None):
        num_output += 1
        first_token_at = first_token_at or time.perf_counter()
        sys.stdout.write(detokenizer.push(step.token_id))
        sys.stdout.flush()
    sys.stdout.write(detokenizer.flush() + "\n")
    end = time.perf_counter()
    decode_rate = (num_output - 1) / (end - first_token_at) if num_output > 1 else 0.0
    print(
        f"[{loaded.name}{'' if loaded.quantization == 'none' else ', ' + loaded.quantization}"
        f"{'' if args.tensor_parallel_size == 1 else f', {args.tensor_parallel_size} ranks'}] "
        f"prompt {len(prompt_ids)} tokens | output {num_output} tokens | "
        f"load {loaded.load_seconds:.2f} s | first token {first_token_at - start:.2f} s | "
        f"decode {decode_rate:.1f} tokens/s",
        file=sys.stderr,
    )
    return 0


def read_image(path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ValueError(f"--image {path}: {e.strerror or e}") from None
