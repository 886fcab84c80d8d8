"""Tokenizers described by GGUF metadata (`tokenizer.ggml.*`), rebuilt as `tokenizers` objects.

llama.cpp stores the vocabulary, merges (or scores) and token kinds; how text is split before merging
is named by `tokenizer.ggml.pre` and lives in llama.cpp's code, so the regexes are reproduced here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from model.errors import ModelLoadError

# llama.cpp's token_type values in GGUF metadata (5 is unused, 6 is a <0xNN> byte token).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's with combining marks kept with the letters they modify (as its tokenizer.json's regex).
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Nemo, Small 3.x, Devstral, Ministral 3) and o200k (Phi-4-mini, "gpt-4o"): words split at
# case changes, as their tokenizer.json writes them (llama.cpp emulates these with lookaheads).
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The regexes llama.cpp applies, in order, for each `tokenizer.ggml.pre` value; anything else gets GPT-2's.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **{name: (r"\p{N}", _GPT2_SPLIT) for name in ("smollm", "starcoder", "refact", "codeshell")},
    **{name: (_LLAMA3_SPLIT,) for name in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "dbrx")},
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen")},
    "qwen35": (_QWEN35_SPLIT,),
    "tekken": (_TEKKEN_SPLIT,),
    **{name: (_GPT4O_SPLIT,) for name in ("gpt-4o", "llama4")},
}
# llama.cpp's Llama-3 and Tekken pre-tokenizers also look whole words up in the vocabulary before merging.
_IGNORE_MERGES = frozenset({"llama3", "llama-bpe", "llama-v3", "smaug-bpe", "dbrx", "tekken"})
# The byte-level vocabularies whose prompts llama.cpp begins with BOS when the file does not say.
BOS_BY_DEFAULT = frozenset({"llama3", "llama-bpe", "llama-v3", "tekken"})
# Control tokens that end a turn; llama.cpp stops on these too, even when they are not the EOS id (Gemma 4:
# <turn|>, and <|tool_response> after a tool call).
END_OF_TURN = frozenset(
    {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
     "<turn|>", "<|tool_response>"}
)


# ------------------------------------------------------------------------------------


def byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str], source: str) -> tokenizers.Tokenizer:
    merges = _merges(metadata, source)
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in _PRE_SPLITS.get(pre, (_GPT2_SPLIT,))]
    # The regexes did the splitting already; ByteLevel only maps bytes to its printable alphabet.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    backend.decoder = decoders.ByteLevel()
    return backend


def spm_merges_bpe(metadata: Mapping[str, Any], tokens: list[str], source: str) -> tokenizers.Tokenizer:
    """Gemma 4's vocabulary (`tokenizer.ggml.model` gemma4): SentencePiece-style pieces (spaces as ▁, no
    prefix space, <0xNN> tokens for bytes without a piece) merged by the file's merges over each line as
    one word; a run of newlines is split off and taken whole when it is a token, as llama.cpp does."""
    merges = _merges(metadata, source)
    vocab = {token: index for index, token in enumerate(tokens)}
    # ignore_merges: a word that is a token is taken whole (llama.cpp does so for newline runs; a whole line
    # that is a token comes out of the merges the same way).
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, byte_fallback=True, ignore_merges=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _merges(metadata: Mapping[str, Any], source: str) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for merge in metadata.get("tokenizer.ggml.merges") or ():
        left, sep, right = str(merge).partition(" ")
        if not sep:
            raise ModelLoadError(f"{source}: malformed tokenizer.ggml.merges entry {str(merge)!r}")
        merges.append((left, right))
    return merges


def sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    # Without scores, earlier tokens rank first, which is how SentencePiece orders its pieces.
    scores = [float(s) for s in metadata.get("tokenizer.ggml.scores") or ()]
    scores += [-float(i) for i in range(len(scores), len(tokens))]
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    merges = _merges_from_scores(tokens, scores, types)
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # Like llama.cpp: each run of plain text (after BOS or any other added token) gets a leading space,
    # spaces become ▁, and the whole run is one word for the merges.
    steps = [normalizers.Replace(" ", "\u2581")]
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    if add_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges: any split of a normal token into two normal tokens, best score first."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, index in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[index], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def add_gguf_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    # Control tokens are matched whole and skipped when decoding with skip_special_tokens; user-defined
    # ones are matched whole but are ordinary text. Both reuse their vocabulary id.
    pairs = list(zip(tokens, types))
    special = [AddedToken(t, special=True, normalized=False) for t, ty in pairs if ty in (CONTROL, UNKNOWN)]
    backend.add_special_tokens(special)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in pairs if ty == USER_DEFINED])
