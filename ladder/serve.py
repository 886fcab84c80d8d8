"""`ladder serve`: the OpenAI-compatible HTTP server.

The listening socket opens first and the model loads behind it (`/ready` answers 503 until then), so
orchestrators see a live process at once. SIGTERM drains: `/ready` turns 503, new requests get 503,
in-flight requests (every HTTP request already in, whether in the engine or still before or after it) run
to completion for up to `--shutdown-timeout` seconds, then the process exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
import time

from engine.config import EngineConfig
from ladder import serve_ray
from ladder.device import add_device_argument
from ladder.lora import add_lora_arguments, lora_config
from ladder.precision import (
    add_auto_dtype_argument,
    add_kv_cache_dtype_argument,
    add_mmproj_argument,
    add_pan_and_scan_argument,
    add_quantization_argument,
    add_vision_dtype_argument,
)
from ladder.pull import add_hub_arguments
from ladder.speculative import add_speculative_arguments, speculative_config
from ladder.tensor_parallel import add_tensor_parallel_argument
from model.default import DEFAULT_MODEL_NAME

log = logging.getLogger("ladder.serve")


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                            description="Serve a model over OpenAI-compatible HTTP endpoints.")
    p.add_argument("--model", default=None,
                   help=f"HF directory, GGUF file, or a hub name org/name[:file.gguf] (default: {DEFAULT_MODEL_NAME})")
    p.add_argument("--artifact", default=None, help="a compiled artifact directory from `ladder compile`")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the file's name)")
    p.add_argument("--api-key", default=os.environ.get("LADDER_API_KEY"),
                   help="require this bearer token (default: $LADDER_API_KEY; none when unset)")
    p.add_argument("--protect-metrics", action=argparse.BooleanOptionalAction, default=None,
                   help="require the API key on /metrics and /stats (the web page's panels) too: they show "
                        "exact prefix-cache hits, which tell whether a prompt was sent before (default: on when "
                        "there is an API key; --no-protect-metrics for a scraper that sends no token)")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="read special-token text in chat messages (e.g. <|im_end|>) as control tokens, as the "
                        "template's own markup is; by default it is plain text, so a message cannot forge a turn")
    p.add_argument("--reasoning-parser", default="auto",
                   choices=["auto", "none", "think", "harmony", "qwen3", "deepseek_r1", "gemma4", "mistral",
                            "openai_gptoss"],
                   help="a reasoning model's <think> block goes to reasoning_content, apart from the content of "
                        "chat replies: auto (when the vocabulary has the markers), none (left in content; GPT-OSS's "
                        "analysis dropped), think (required; qwen3, deepseek_r1, gemma4 and mistral, vLLM's names, "
                        "mean the same), harmony (GPT-OSS's analysis channel, required; vLLM's openai_gptoss)")
    p.add_argument("--reranker", default="auto", choices=["auto", "on", "off"],
                   help="serve POST /v1/rerank, scoring each document by the model's next-token odds of 'yes' "
                        "against 'no' (Qwen3-Reranker's rule): auto (a model whose name says reranker), on, off")
    p.add_argument("--reasoning-budget", type=int, default=None,
                   help="the most tokens a reasoning model may think before its </think> is written for it, for "
                        "requests that give no reasoning_budget (default: no bound; 0: answer without thinking)")
    add_auto_dtype_argument(p)
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences computed together per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens per step while other requests decode, so their streams keep flowing "
                        "(default: no bound, the whole --max-num-batched-tokens)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt plus output (default: model's)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="sequences in flight, counted as prompts x n of every request, before 429 (default 256)")
    p.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="prompts in one /v1/completions request (default 64)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="characters of one prompt (or of all chat messages) tokenized at most "
                        "(default: 32 x max_model_len)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed event: a sample's first tokens and its end go at once, the rest in "
                        "events of this many (default 1; larger costs the server and any relay, such as the Ray "
                        "ingress, less per token)")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds one engine step may run before the server reports the engine hung (503) "
                        "(default 300; 0 turns the watchdog off)")
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="GiB for the KV cache (default: --gpu-memory-utilization on CUDA, "
                        "--kv-cache-memory-fraction on a CPU)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.25,
                   help="on a CPU, the fraction of available memory for the KV cache, at most 2 GiB (default 0.25)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA, the fraction of the device's memory to fill: the KV cache gets this share less "
                        "what is in use once the model is loaded (default 0.9)")
    add_kv_cache_dtype_argument(p)
    add_vision_dtype_argument(p)
    add_mmproj_argument(p)
    add_pan_and_scan_argument(p)
    p.add_argument("--vision-tiles-per-step", type=int, default=1,
                   help="image tiles the vision tower runs between two engine steps, so running requests wait "
                        "a tile at a time (0: each prompt's images whole)")
    p.add_argument("--image-cache-mib", type=int, default=256,
                   help="MiB of the vision tower's outputs kept by image, so a chat that sends its image again "
                        "skips the tower (least recently used out; 0: none)")
    p.add_argument("--block-size", type=int, default=16)
    add_device_argument(p)
    add_quantization_argument(p)
    add_tensor_parallel_argument(p)
    add_lora_arguments(p)
    add_speculative_arguments(p)
    add_hub_arguments(p)
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="the chat template to use instead of the model's: a Jinja file, a tokenizer_config.json "
                        "holding one, or the template text")
    p.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="auto: a request's temperature, top_p, top_k, min_p and repetition_penalty default to the "
                        "model's generation_config.json when it leaves them out; none: ladder's defaults")
    p.add_argument("--pooling", default="auto", choices=["auto", "last", "mean", "cls"],
                   help="how /v1/embeddings pools a text's final hidden states: auto, the rule the checkpoint "
                        "declares (sentence-transformers files, GGUF pooling_type), else the last token's")
    p.add_argument("--embedding-normalize", default="auto", choices=["auto", "on", "off"],
                   help="L2-normalize embeddings: auto, as the checkpoint's rule says (else on)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight requests")
    p.add_argument("--max-body-bytes", type=int, default=20 << 20,
                   help="larger request bodies get 413 (default 20 MiB: a chat's base64 images count)")
    p.add_argument("--max-images-per-prompt", type=int, default=8,
                   help="a vision model's chat requests hold at most this many images")
    p.add_argument("--allowed-image-domains", nargs="+", default=(), metavar="HOST",
                   help="hosts whose http(s) image URLs a vision model's chats may name (`*.example.com` for "
                        "subdomains, `*` any host); default none: images come as data: URLs (base64)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve_ray.add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from engine.async_engine import AsyncLLMEngine
        from engine.llm_engine import LLMEngine
        from server.app import ServerSettings, ServerState, create_app
    except ImportError as error:
        raise ValueError(f"ladder serve needs the server extra ({error.name} is missing): "
                         "pip install 'ladder[server]'") from None
    if args.artifact is not None and args.model is not None:
        raise ValueError("give --model or --artifact, not both")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be at least 1, got {args.max_queue}")
    if args.max_prompts_per_request < 1:
        raise ValueError(f"--max-prompts-per-request must be at least 1, got {args.max_prompts_per_request}")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be at least 1, got {args.stream_interval}")
    if args.max_prompt_chars is not None and args.max_prompt_chars < 1:
        raise ValueError(f"--max-prompt-chars must be at least 1, got {args.max_prompt_chars}")
    if args.step_timeout < 0:
        raise ValueError(f"--step-timeout must be 0 (off) or positive, got {args.step_timeout}")
    if args.protect_metrics and args.api_key is None:
        raise ValueError("--protect-metrics needs an API key (--api-key or $LADDER_API_KEY)")
    config = EngineConfig(
        model=args.model, artifact=args.artifact, dtype=args.dtype, device=args.device,
        quantization=args.quantization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_tokens=args.max_prefill_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory_gib=args.kv_cache_memory,
        vision_dtype=args.vision_dtype, mmproj=args.mmproj, vision_tiles_per_step=args.vision_tiles_per_step,
        image_cache_mib=args.image_cache_mib, pan_and_scan=args.pan_and_scan,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size, tensor_parallel_attention=args.tensor_parallel_attention,
        **lora_config(args), **speculative_config(args), chat_template=args.chat_template,
        generation_config=args.generation_config, revision=args.revision, download_dir=args.download_dir,
        pooling=args.pooling, embedding_normalize={"auto": None, "on": True, "off": False}[args.embedding_normalize],
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.artifact is None:
        log.info("dtype %s%s, quantization %s, on %s", config.dtype, " (auto)" if args.dtype == "auto" else "",
                 config.quantization, config.device)
    settings = ServerSettings(served_model_name=args.served_model_name, api_key=args.api_key,
                              max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                              max_prompts_per_request=args.max_prompts_per_request,
                              max_prompt_chars=args.max_prompt_chars, stream_interval=args.stream_interval,
                              protect_metrics=args.protect_metrics,
                              allow_special_tokens_in_content=args.allow_special_tokens_in_content,
                              reasoning_parser=args.reasoning_parser, reranker=args.reranker,
                              reasoning_budget=args.reasoning_budget,
                              max_images_per_prompt=args.max_images_per_prompt,
                              allowed_image_domains=tuple(args.allowed_image_domains))
    if args.ray:
        server_kwargs = {k: v for k, v in dataclasses.asdict(settings).items() if k != "created"}
        # The dtype as asked too: each replica resolves auto for its own device.
        engine_kwargs = {**serve_ray.engine_kwargs_of(config, args.device, args.quantization), "dtype": args.dtype}
        return serve_ray.run(args, engine_kwargs, server_kwargs)
    state = ServerState(settings)
    server = DrainingServer(uvicorn.Config(create_app(state), host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_graceful_shutdown=5),
                            state, args.shutdown_timeout)
    failure: list[str] = []

    def load() -> None:
        try:
            start = time.perf_counter()
            state.attach(AsyncLLMEngine(LLMEngine(config), step_timeout=args.step_timeout or None))
            info = state.engine.info
            log.info("serving %s (%s) as %r on http://%s:%d (loaded in %.1f s; KV cache %d blocks of %d tokens "
                     "in %s, max_model_len %d)", info.model_path, info.precision, state.model_name, args.host,
                     args.port, time.perf_counter() - start, info.num_kv_blocks, info.block_size, info.kv_cache_dtype,
                     info.max_model_len)
        except Exception as error:  # report one line and stop the server
            failure.append(" ".join(str(error).split()) or type(error).__name__)
            state.load_error = "the model failed to load"
            server.should_exit = True

    threading.Thread(target=load, name="ladder-load", daemon=True).start()
    server.run()
    if state.engine is not None:
        state.engine.shutdown()
    if failure:
        raise ValueError(failure[0])
    return 0


try:
    import uvicorn as _uvicorn

    _ServerBase = _uvicorn.Server
except ImportError:  # the server extra is missing: `run` says so
    _ServerBase = object


class DrainingServer(_ServerBase):
    """uvicorn's server with a draining first SIGTERM (a second signal exits at once)."""

    def __init__(self, config, state, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining or sig != signal.SIGTERM:
            return super().handle_exit(sig, frame)
        self.state.draining = True
        log.info("SIGTERM: draining for up to %.0f s", self.shutdown_timeout)
        threading.Thread(target=self._drain, name="ladder-drain", daemon=True).start()

    def _drain(self) -> None:
        # Every HTTP request counts, not only the engine's streams: one still being read, tokenized or
        # rendered has not reached the engine yet, and a finished one may still be sending its response.
        deadline = time.monotonic() + self.shutdown_timeout
        while time.monotonic() < deadline:
            engine = self.state.engine
            if self.state.num_requests == 0 and (engine is None or engine.num_in_flight == 0):
                break
            time.sleep(0.05)
        self.should_exit = True

