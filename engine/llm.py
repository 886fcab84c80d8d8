"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`, and `.embed(texts)`."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Sequence

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from model.chat_template import reads_content_parts
from model.image_processor import data_url_bytes
from model.loader import LoadedModel
from model.lora import adapter_name
from model.pooling import finish_embedding
from model.vision import EncodedImages


class LLM:
    def __init__(self, model: str | None = None, loaded: LoadedModel | None = None, lora: str | None = None,
                 **config) -> None:
        """`model`: HF directory, GGUF file, or None for the embedded default (or `loaded`, a model already
        loaded with `model.load`); `lora`: a LoRA adapter (PEFT directory or GGUF) every prompt runs with
        unless `generate` names another; `config`: EngineConfig fields (`lora_modules` for several)."""
        self.default_lora = None
        if lora is not None:
            self.default_lora = adapter_name(lora)
            modules = config.get("lora_modules", ())
            modules = tuple(modules.items()) if isinstance(modules, dict) else tuple(modules)
            config["lora_modules"] = (*modules, (self.default_lora, str(lora)))
        self.engine = LLMEngine(EngineConfig(model=model, **config), loaded=loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
        images: Sequence[EncodedImages | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in the prompts' order.

        A prompt is text (encoded as is, BOS added if the model wants it) or a list of token ids. `lora`: an
        adapter's name for every prompt, or one per prompt (None: the base model); by default the `lora`
        the LLM was made with. `images`: per prompt, the embeddings of its `<image>` tokens (`chat` makes
        them from a conversation's images), or None.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.default_sampling_params()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        lora = self.default_lora if lora is None else lora
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA adapters")
        images = list(images) if images is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} image entries")
        results: dict[str, RequestOutput] = {}
        for prompt, p, adapter, encoded in zip(prompts, params_list, loras, images):
            token_ids = self._encode(prompt)
            request_id = str(next(self._ids))
            results[request_id] = RequestOutput(request_id, token_ids, [CompletionOutput(i) for i in range(p.n)])
            self.engine.add_request(request_id, token_ids, p, lora=adapter, images=encoded)
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                result = results[delta.request_id]
                result.outputs[delta.index].add(delta)
                if delta.prompt_logprobs is not None and result.prompt_logprobs is None:
                    result.prompt_logprobs = delta.prompt_logprobs
        return list(results.values())

    def embed(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], dimensions: int | None = None,
              lora: str | None = None) -> torch.Tensor:
        """One embedding per prompt, [len(prompts), dimensions or hidden] float32, in the prompts' order: the
        final hidden states pooled by the engine's rule (`engine.pooling`: the checkpoint's, or the last
        token's), cut to `dimensions`, L2-normalized unless the rule says not to. All run batched together."""
        hidden = self.engine.model.config.hidden_size
        if dimensions is not None and not 1 <= dimensions <= hidden:
            raise ValueError(f"dimensions must be in [1, {hidden}], the model's hidden size; got {dimensions}")
        pooled = self._pool(prompts, SamplingParams(max_tokens=1), self.engine.pooling.kind, lora)
        normalize = self.engine.pooling.normalize
        return torch.stack([finish_embedding(vector, normalize, dimensions) for vector in pooled])

    def next_token_logits(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], token_ids: Sequence[int],
                          lora: str | None = None) -> torch.Tensor:
        """[len(prompts), len(token_ids)] float32: after each prompt, the logits of `token_ids` as its next
        token (the model's own: no sampling field applies), all batched together; a choice among a few
        answers (a reranker's "no" and "yes", a multiple-choice letter) without generating."""
        if not token_ids:
            raise ValueError("token_ids is empty")
        params = SamplingParams(max_tokens=1, score_token_ids=tuple(token_ids))
        return torch.stack(self._pool(prompts, params, "last", lora))

    def _pool(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], params: SamplingParams, pooling: str,
              lora: str | None) -> list[torch.Tensor]:
        """Each prompt's pooled request run in one batch: the `embedding` of its last delta, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        pooled: dict[str, torch.Tensor] = {}
        order = []
        for prompt in prompts:
            request_id = f"embed-{next(self._ids)}"
            order.append(request_id)
            self.engine.add_request(request_id, self._encode(prompt), params,
                                    lora=self.default_lora if lora is None else lora, pooling=pooling)
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                if delta.error is not None:
                    raise RuntimeError(f"embedding request {delta.request_id} failed: {delta.error}")
                if delta.embedding is not None:
                    pooled[delta.request_id] = delta.embedding
        return [pooled[i] for i in order]

    def default_sampling_params(self) -> SamplingParams:
        """The parameters of a call that gives none: the model's generation_config.json sampling fields
        (unless the engine was made with generation_config="none"), ladder's defaults for the rest."""
        return SamplingParams(**self.engine.sampling_defaults)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             chat_template_kwargs: dict | None = None) -> RequestOutput:
        """One conversation through the model's chat template; `chat_template_kwargs` become template
        variables (Qwen3's `enable_thinking`). A vision model's messages may hold images among their content
        parts: `{"type": "image", "image": bytes | path}` or OpenAI's `{"type": "image_url", "image_url":
        {"url": "data:...;base64,..."}}`."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        vision = self.engine.vision
        parts = vision is not None and reads_content_parts(self.tokenizer.chat_template or "")
        sources: list = []
        rendered = [template_message(m, parts, sources) for m in messages]
        if sources and vision is None:
            raise ValueError(f"{self.engine.model.name} takes no images")
        text = self.tokenizer.apply_chat_template(rendered, **(chat_template_kwargs or {}))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        encoded = None
        if sources:
            processed = [vision.processor.process(image_bytes(source)) for source in sources]
            ids = vision.processor.place(ids, processed, self.tokenizer)
            encoded = self.engine.encode_images(processed)
        return self.generate([ids], sampling_params, images=[encoded])[0]

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)


def template_message(message: dict, parts: bool, images: list) -> dict:
    """A message as the chat template reads it: its image parts collected into `images` (in order) and
    written `{"type": "image"}`; with `parts`, text content as a list of parts too (a vision model's
    template reads content only so); else parts' texts joined."""
    content = message.get("content")
    if isinstance(content, str) or content is None:
        return {**message, "content": [{"type": "text", "text": content}]} if parts and content is not None \
            else message
    out = []
    for part in content:
        kind = part.get("type")
        if kind in ("image", "image_url"):
            images.append(part.get("image") if kind == "image" else (part.get("image_url") or {}).get("url"))
            out.append({"type": "image"})
        elif kind == "text":
            out.append({"type": "text", "text": part.get("text", "")})
        else:
            raise ValueError(f"content parts of type {kind!r} are not supported (text, image, image_url)")
    if parts or any(p["type"] == "image" for p in out):  # images without parts: the caller refuses them
        return {**message, "content": out}
    return {**message, "content": "".join(p["text"] for p in out)}


def image_bytes(source) -> bytes:
    """An image given to `LLM.chat`: bytes, a `data:...;base64,` URL, or a file's path."""
    if isinstance(source, bytes | bytearray):
        return bytes(source)
    if isinstance(source, str) and source.startswith("data:"):
        return data_url_bytes(source)
    if isinstance(source, str | Path):
        return Path(source).expanduser().read_bytes()
    raise ValueError(f"an image must be bytes, a data: URL or a path, not {type(source).__name__}")
