"""POST /v1/rerank (also /rerank and /v2/rerank): documents ranked by their relevance to a query; and vLLM's
POST /v1/score (also /score): the same scores for pairs of texts, in their order.

A reranker such as Qwen3-Reranker is a causal language model asked, through its chat template, whether a
document meets a query: a system turn with the judging rule, a user turn with the instruction, the query
and the document, and the assistant's turn opened with an empty reasoning block (the template's
`enable_thinking: false`). The relevance score is the probability of "yes" against "no" as the next token,
sigmoid(logit_yes - logit_no), as the model card computes it. Each document runs as an embedding request
pooled by its last token whose last delta carries those two logits (SamplingParams.score_token_ids), in the
continuous batch beside the generating requests; the documents of a request share the prompt's start, which
the prefix cache computes once.

A model is served as a reranker when its name says so ("rerank" in it) or its GGUF file is one (llama.cpp's
conversion: the "yes" and "no" rows of the LM head as a classification head, read by model/loader.py), and
its vocabulary has "yes" and "no" as tokens; or when `--reranker on` asks for it (any chat model then judges
with the same prompt).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from model.tokenizer import Tokenizer
from server import protocol as p
from server.embeddings import EMBEDDING_WINDOW, embed_all
from server.errors import APIError
from server.generation import new_id
from server.prompts import check_chars

if TYPE_CHECKING:
    from server.app import ServerState

ERRORS = {status: {"model": p.ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}
SETTINGS = ("auto", "on", "off")
JUDGE = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
         'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class Reranker:
    """How the served model ranks: its answer tokens, and its chat template's prompt."""

    no_id: int
    yes_id: int

    @classmethod
    def find(cls, setting: str, model_name: str, tokenizer: Tokenizer | None, declared: bool = False
             ) -> Reranker | None:
        """`--reranker`: auto (a model named a reranker, or a reranker file (`declared`), with the tokens), on
        (required), off. Raises ValueError for a setting this model cannot meet."""
        if setting not in SETTINGS:
            raise ValueError(f"unknown reranker setting {setting!r}; one of {', '.join(SETTINGS)}")
        if setting == "off" or (setting == "auto" and not declared and "rerank" not in model_name.lower()):
            return None
        ids = (tokenizer.token_to_id("no"), tokenizer.token_to_id("yes")) if tokenizer is not None else (None,)
        usable = tokenizer is not None and None not in ids and bool(tokenizer.chat_template)
        if not usable:
            if setting == "on":
                raise ValueError("--reranker on needs a chat template and 'yes' and 'no' as tokens of the "
                                 "model's vocabulary")
            return None
        return cls(*ids)

    @property
    def score_token_ids(self) -> tuple[int, int]:
        return self.no_id, self.yes_id

    @staticmethod
    def messages(query: str, document: str, instruction: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": JUDGE},
                {"role": "user", "content": f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"}]

    @staticmethod
    def score(logits) -> float:
        """logits [2] (no, yes) -> P(yes | yes or no)."""
        margin = float(logits[1] - logits[0])
        return 1.0 / (1.0 + math.exp(-margin)) if margin >= -700 else 0.0


def install_rerank_routes(app: FastAPI, state: ServerState, authorize,
                          admit: Callable[[p.RerankRequest], tuple[AsyncLLMEngine, str | None]],
                          until_disconnected: Callable[[Request, Awaitable], Awaitable]) -> None:
    @app.post("/v1/rerank", response_model=p.RerankResponse, responses=ERRORS, dependencies=[Depends(authorize)])
    @app.post("/v2/rerank", response_model=p.RerankResponse, responses=ERRORS, dependencies=[Depends(authorize)],
              include_in_schema=False)
    @app.post("/rerank", response_model=p.RerankResponse, responses=ERRORS, dependencies=[Depends(authorize)],
              include_in_schema=False)
    async def rerank(body: p.RerankRequest, request: Request) -> p.RerankResponse:
        texts = body.texts
        scores, num_tokens = await score_pairs(body, [(body.query, t) for t in texts], body.instruction, request,
                                               "documents", "document")
        results = [p.RerankResult(index=i, relevance_score=score,
                                  document=p.RerankDocument(text=texts[i]) if body.return_documents else None)
                   for i, score in enumerate(scores)]
        results.sort(key=lambda r: (-r.relevance_score, r.index))
        return p.RerankResponse(id=new_id("rerank"), model=body.model or state.model_name,
                                usage=p.RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
                                results=results[:body.top_n])

    @app.post("/v1/score", response_model=p.ScoreResponse, responses=ERRORS, dependencies=[Depends(authorize)])
    @app.post("/score", response_model=p.ScoreResponse, responses=ERRORS, dependencies=[Depends(authorize)],
              include_in_schema=False)
    async def score(body: p.ScoreRequest, request: Request) -> p.ScoreResponse:
        """vLLM's score API: `text_1` against each `text_2`, or the texts pairwise; scores in input order."""
        scores, num_tokens = await score_pairs(body, body.pairs, body.instruction, request, "text_2", "pair")
        return p.ScoreResponse(id=new_id("score"), created=int(time.time()), model=body.model or state.model_name,
                               data=[p.Score(index=i, score=s) for i, s in enumerate(scores)],
                               usage=p.RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))

    async def score_pairs(body: p.RerankRequest | p.ScoreRequest, pairs: list[tuple[str, str]],
                          instruction: str | None, request: Request, param: str, what: str
                          ) -> tuple[list[float], int]:
        """Each (query, document) pair's relevance score, in order, and the prompt tokens they took."""
        engine, lora = admit(body)
        info = engine.info
        reranker = state.reranker
        if reranker is None:
            raise APIError(400, f"{state.model_name} is not served as a reranker (ladder serve --reranker on "
                                "serves a chat model as one; a model named a reranker is one by default)",
                           param="model")
        if info.embeddings_unavailable is not None:
            raise APIError(400, info.embeddings_unavailable)
        limit = state.settings.prompt_char_limit(info.max_model_len)
        check_chars(max(len(q) + len(d) for q, d in pairs), limit, "query and document")
        window = min(len(pairs), EMBEDDING_WINDOW)
        reservation = state.admission.reserve(window)
        try:
            ids = await asyncio.to_thread(prompts, info.tokenizer, pairs, instruction or DEFAULT_INSTRUCTION)
            for i, prompt in enumerate(ids):
                if len(prompt) > info.max_model_len:
                    raise APIError(400, f"{what} {i} makes a prompt of {len(prompt)} tokens; this model takes "
                                        f"at most {info.max_model_len}", param=param, code="context_length_exceeded")
            logits = await until_disconnected(request, embed_all(engine, ids, lora, window,
                                                                 reranker.score_token_ids))
        except EngineDeadError:
            raise APIError(503, "the engine has stopped after an internal error") from None
        finally:
            reservation.release()
        return [reranker.score(pair) for pair in logits], sum(len(prompt) for prompt in ids)


def prompts(tokenizer: Tokenizer, pairs: list[tuple[str, str]], instruction: str) -> list[list[int]]:
    """Each (query, document) pair's prompt ids, through the chat template (special-token text in a query or
    a document is plain text). CPU-heavy: off the event loop."""
    out = []
    for query, document in pairs:
        try:
            _, ids = tokenizer.encode_chat(Reranker.messages(query, document, instruction), True,
                                           enable_thinking=False)
        except ValueError as error:
            raise APIError(400, f"the chat template rejected the rerank prompt: {error}") from None
        out.append(ids)
    return out
