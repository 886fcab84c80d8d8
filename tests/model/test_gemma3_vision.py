"""Gemma 3 reading images (model/vision.py, model/image_processor.py), against transformers on the same
weights: a tiny random Gemma 3 whose images are 64 pixels, pooled to 16 tokens, with a sliding-window layer
of 12 tokens (shorter than an image) beside a full one.

The tile equals transformers' image processor's, the prompt ids its processor's placement (newlines merged
with the text beside each image), the tower's embeddings its own; and the engine's log-probabilities of
every prompt token and its greedy tokens equal Gemma3ForConditionalGeneration's, whose image tokens attend
to their whole image (both ways) under both kinds of layer: in one prefill, in chunks smaller than an image
(the scheduler keeps each image in one chunk), and after a prefix-cache hit that ends inside an image. Image
chats preempted and computed again give their solo tokens. The same model as llama.cpp's GGUF and mmproj
files reads images alike."""

from __future__ import annotations

import json

import pytest
import torch
from random_images import png

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampling_params import SamplingParams
from model.loader import load
from model.step import SeqChunk, build_step, run_key_ends
from model.vision import image_spans

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

BOI = "<start_of_image>"


def user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                        for p in parts]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import make_tiny_gemma3_vision_model

    return make_tiny_gemma3_vision_model(tmp_path_factory.mktemp("models") / "tiny-gemma3-vision")


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load(model_dir, vision_dtype="float32")  # the checkpoint's own arithmetic, for exact parity


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import Gemma3ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    config = json.loads((model_dir / "preprocessor_config.json").read_text())
    config.pop("image_processor_type")
    config["do_convert_rgb"] = True  # the released config leaves it null, which takes RGBA as four channels
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    return (Gemma3ImageProcessorPil(**config), tokenizer,
            Gemma3ForConditionalGeneration.from_pretrained(model_dir).eval())


def reference_ids(loaded, tokenizer, messages: list[dict]) -> list[int]:
    """Gemma3Processor's ids: each <start_of_image> of the rendered chat replaced in the text, then encoded."""
    text = loaded.tokenizer.apply_chat_template(messages)
    full = f"\n\n{BOI}{'<image_soft_token>' * 16}<end_of_image>\n\n"
    return tokenizer(text.replace(BOI, full), add_special_tokens=False)["input_ids"]


def prompt_ids(loaded, data: list[bytes], messages: list[dict]) -> tuple[list[int], list]:
    vision = loaded.module.vision
    images = [vision.processor.process(d) for d in data]
    _, ids = loaded.tokenizer.encode_chat(messages)
    return vision.processor.place(ids, images, loaded.tokenizer), images


@pytest.mark.parametrize("size,mode", [((50, 70), "RGB"), ((64, 64), "RGB"), ((300, 120), "RGB"),
                                       ((33, 41), "RGBA"), ((80, 60), "L")])
def test_tile_equals_the_checkpoints_processor(loaded, reference, size, mode):
    image_processor, _, _ = reference
    data, image = png(*size, seed=sum(size), mode=mode)
    expected = image_processor(images=[image], return_tensors="pt")["pixel_values"]
    assert torch.equal(loaded.module.vision.processor.process(data).pixels, expected)


@pytest.mark.parametrize("messages", [
    [user(None, "What is this?")],
    [{"role": "system", "content": "Be brief."}, user("Compare", None, "and", None, "please.")],
    [user("Look:\n", None), {"role": "assistant", "content": "A cat."}, user(None)],
])
def test_prompt_ids_equal_the_processors_text_placement(loaded, reference, messages):
    _, tokenizer, _ = reference
    count = sum(part.get("type") == "image" for m in messages if isinstance(m["content"], list)
                for part in m["content"])
    data = [png(40, 40, seed=k)[0] for k in range(count)]
    ids, _ = prompt_ids(loaded, data, messages)
    assert ids == reference_ids(loaded, tokenizer, messages)
    vision = loaded.module.vision
    assert [end - start for start, end in image_spans([i for i, t in enumerate(ids) if t == vision.image_token_id])] \
        == [16] * count


def test_the_towers_embeddings_equal_transformers(loaded, reference):
    image_processor, _, model = reference
    data, image = png(50, 70, seed=1)
    pixels = image_processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = model.model.get_image_features(pixels).pooler_output[0]
    got = loaded.module.vision.encode([loaded.module.vision.processor.process(data)]).embeds
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_a_step_gives_each_image_token_its_images_end():
    rows = [3, 4, 5, 9, 10]  # two runs of a chunk that starts at position 20
    assert run_key_ends(rows, 7, 20) == {10: 26, 11: 26, 12: 26, 16: 31, 17: 31}
    from model.step import InputEmbeds

    chunk = SeqChunk(list(range(8)), 4, [0, 1], 8, embeds=InputEmbeds(torch.tensor([2, 3, 4]), torch.zeros(3, 2),
                                                                      bidirectional=True))
    step = build_step([SeqChunk([1], 5, [2], 1), chunk], 16, "cpu")
    assert step.attn_metadata.key_ends.tolist() == [6, 5, 6, 9, 9, 9, 10, 11, 12]


def test_a_chunk_never_ends_inside_an_image():
    request = Request("r", list(range(60)), SamplingParams(max_tokens=1), frozenset(), image_spans=[(10, 26), (40, 56)])
    assert request.chunk_end(0, 8) == 8
    assert request.chunk_end(0, 15) == 10  # would cut the first image: stops before it
    assert request.chunk_end(10, 14) == 26  # starts at the image: runs to its end, over the budget
    assert request.chunk_end(18, 20) == 26  # starts inside it (a cache hit): the same
    assert request.chunk_end(26, 45) == 40
    assert request.chunk_end(0, 60) == 60


def reference_run(reference, loaded, ids: list[int], images: list, max_tokens: int):
    """transformers' prompt log-probabilities and greedy tokens, image tokens marked as the processor marks them."""
    _, _, model = reference
    pixels = torch.cat([image.pixels for image in images])
    input_ids = torch.tensor([ids])
    token_type_ids = (input_ids == loaded.module.vision.image_token_id).long()
    with torch.no_grad():
        logits = model(input_ids=input_ids, pixel_values=pixels, token_type_ids=token_type_ids).logits[0].float()
        out = model.generate(input_ids=input_ids, pixel_values=pixels, token_type_ids=token_type_ids,
                             attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        causal = model(input_ids=input_ids, pixel_values=pixels).logits[0].float()  # no image blocks
    generated = out.sequences[0, len(ids):].tolist()
    sampled = torch.stack([torch.log_softmax(score[0].float(), -1)[t] for score, t in zip(out.scores, generated)])
    index = torch.arange(len(ids) - 1), torch.tensor(ids[1:])
    return torch.log_softmax(logits, -1)[index], generated, torch.log_softmax(causal, -1)[index], sampled


def engine_run(engine: LLMEngine, request_id: str, ids: list[int], images: list, max_tokens: int,
               prompt: bool = True):
    """The prompt's log-probabilities (`prompt`; a request that scores its prompt skips the prefix cache)
    or else the sampled tokens', the greedy tokens, and the tokens found cached."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, **({"prompt_logprobs": 0} if prompt else
                                                                      {"logprobs": 0}))
    engine.add_request(request_id, ids, params, images=engine.encode_images(images))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    if prompt:
        scored = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs)
        logprobs = torch.tensor([entry.logprob for entry in scored if entry is not None])
    else:
        logprobs = torch.tensor([entry.logprob for d in deltas for entry in d.logprobs])
    return logprobs, [t for d in deltas for t in d.token_ids], max(d.num_cached_tokens for d in deltas)


MESSAGES = [{"role": "system", "content": "Answer in one word."}, user(None, "What is in the picture?")]


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 10])
def test_prompt_logprobs_and_greedy_tokens_equal_transformers(loaded, reference, max_num_batched_tokens):
    """10-token chunks are shorter than an image's 16 tokens: the chunk that reaches an image runs it whole."""
    data, _ = png(50, 70, seed=1)
    ids, images = prompt_ids(loaded, [data], MESSAGES)
    expected, generated, causal, _ = reference_run(reference, loaded, ids, images, 6)
    engine = LLMEngine(EngineConfig(model=str(loaded.path), quantization="none", enable_prefix_caching=False,
                                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=512,
                                    kv_cache_memory_gib=0.01), loaded=loaded)
    got, tokens, _ = engine_run(engine, "a", ids, images, 6)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    assert tokens == generated
    # The image blocks matter: a causal mask over the image's tokens scores the tokens after them otherwise.
    first = ids.index(loaded.module.vision.image_token_id)
    assert (expected[first:] - causal[first:]).abs().max() > 1e-2
    assert torch.equal(expected[:first], causal[:first])


def test_a_prefix_cache_hit_inside_an_image_gives_the_same_answer(loaded, reference):
    """The second request's cached blocks end inside the image: its first chunk runs the rest of the image,
    whose tokens see the cached ones as before."""
    data, _ = png(60, 30, seed=2)
    vision = loaded.module.vision
    for pad in range(16):  # a system prompt that puts a block boundary inside the image, near its end
        messages = [{"role": "system", "content": "Be brief." + " ok" * pad}, user(None, "Name it.")]
        ids, images = prompt_ids(loaded, [data], messages)
        (start, end), = image_spans([i for i, t in enumerate(ids) if t == vision.image_token_id])
        hit = (len(ids) - 1) // 16 * 16  # the full blocks a repeat finds cached
        if start < hit < end:
            break
    else:
        pytest.fail("no system prompt put a cached block's end inside the image")
    _, generated, _, sampled = reference_run(reference, loaded, ids, images, 6)
    engine = LLMEngine(EngineConfig(model=str(loaded.path), quantization="none", enable_prefix_caching=True,
                                    max_model_len=512, kv_cache_memory_gib=0.01), loaded=loaded)
    first, tokens, num_cached = engine_run(engine, "first", ids, images, 6, prompt=False)
    assert (tokens, num_cached) == (generated, 0)
    repeat, tokens, num_cached = engine_run(engine, "repeat", ids, images, 6, prompt=False)
    assert (tokens, num_cached) == (generated, hit)
    torch.testing.assert_close(first, sampled, atol=2e-5, rtol=0)
    torch.testing.assert_close(repeat, sampled, atol=2e-5, rtol=0)


def test_the_gguf_and_mmproj_files_read_images_as_the_directory_does(model_dir, loaded, reference, tmp_path):
    from tiny_models import write_gemma3_vision_gguf

    write_gemma3_vision_gguf(model_dir, tmp_path / "text.gguf", tmp_path / "mmproj.gguf")
    files = load(tmp_path / "text.gguf", mmproj=tmp_path / "mmproj.gguf", vision_dtype="float32")
    vision, expected_vision = files.module.vision, loaded.module.vision
    assert vision.processor == expected_vision.processor  # the same tile, tokens and normalization
    data, image = png(50, 70, seed=1)
    ids, images = prompt_ids(files, [data], MESSAGES)
    assert ids == prompt_ids(loaded, [data], MESSAGES)[0]
    image_processor, _, model = reference
    with torch.no_grad():
        features = model.model.get_image_features(image_processor(images=[image], return_tensors="pt")
                                                  ["pixel_values"]).pooler_output[0]
    # The file's projection is float16, as llama.cpp's converter writes it.
    embeds = vision.encode(images).embeds
    assert ((embeds - features).norm() / features.norm()).item() < 1e-3
    engines = [LLMEngine(EngineConfig(model=str(m.path), quantization="none", max_model_len=512,
                                      kv_cache_memory_gib=0.01), loaded=m) for m in (files, loaded)]
    (got, tokens, _), (expected, expected_tokens, _) = [engine_run(e, "g", ids, images, 6) for e in engines]
    assert tokens == expected_tokens
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=0)


def test_image_chats_under_preemption_give_their_solo_tokens(loaded):
    """Image and text chats at once through a cache too small for all of them: requests are preempted and
    their prompts, images and all, computed again; each gives the tokens it gives alone."""
    from engine.config import bytes_per_block

    chats = [[user(None, f"What is in picture {k}?")] for k in range(4)]
    chats += [[user("Compare", None, "and", None, "please.")], [user("Say hello to me.")]]
    requests = []
    for k, messages in enumerate(chats):
        count = sum(part.get("type") == "image" for m in messages for part in m["content"])
        requests.append(prompt_ids(loaded, [png(40 + 10 * k, 50, seed=10 + k + j)[0] for j in range(count)], messages))

    def run_all(engine: LLMEngine) -> dict[str, list[int]]:
        for k, (ids, images) in enumerate(requests):
            engine.add_request(str(k), ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                               images=engine.encode_images(images) if images else None)
        out: dict[str, list[int]] = {str(k): [] for k in range(len(requests))}
        while engine.has_unfinished():
            for delta in engine.step():
                out[delta.request_id].extend(delta.token_ids)
        return out

    def config(**overrides) -> EngineConfig:
        return EngineConfig(model=str(loaded.path), quantization="none", enable_prefix_caching=False,
                            max_model_len=96, **{"kv_cache_memory_gib": 0.01, **overrides})

    solo = {}
    for k, (ids, images) in enumerate(requests):
        engine = LLMEngine(config(), loaded=loaded)
        engine.add_request("s", ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                           images=engine.encode_images(images) if images else None)
        tokens = []
        while engine.has_unfinished():
            tokens += [t for d in engine.step() for t in d.token_ids]
        solo[str(k)] = tokens
    per_block = bytes_per_block(loaded.config, 16, torch.float32)
    tight = LLMEngine(config(kv_cache_memory_gib=6 * per_block / 2**30), loaded=loaded)
    together = run_all(tight)
    assert tight.stats.num_preemptions > 0
    assert together == solo


@pytest.mark.parametrize("size", [(100, 400), (600, 200), (300, 280), (120, 1000), (250, 600)])
def test_pan_and_scan_crops_and_ids_equal_the_checkpoints_processor(loaded, reference, size):
    """With do_pan_and_scan, a wide or tall image is followed by its crops (each a tile of its own, in the
    processor's text around them); a nearly square one, or one whose crops would be too small, is not cut."""
    import dataclasses

    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from model.image_processor import Gemma3ImageProcessor, PanAndScan

    _, tokenizer, _ = reference
    raw = {**json.loads((loaded.path / "preprocessor_config.json").read_text()), "do_pan_and_scan": True,
           "pan_and_scan_min_crop_size": 64, "pan_and_scan_max_num_crops": 3, "pan_and_scan_min_ratio_to_activate": 1.2}
    ours = Gemma3ImageProcessor.from_config(raw, loaded.module.vision.encoder.config)
    assert ours.pan_and_scan == PanAndScan(64, 3, 1.2)
    raw.pop("image_processor_type")
    expected = Gemma3ImageProcessorPil(**{**raw, "do_convert_rgb": True})
    data, image = png(*size, seed=sum(size))
    processed = ours.process(data)
    reference_out = expected(images=[image], return_tensors="pt")
    assert processed.cols == int(reference_out["num_crops"][0])
    assert torch.equal(processed.pixels, reference_out["pixel_values"])
    # The ids: Gemma3Processor's text for the crops, placed in the rendered chat and encoded whole.
    messages = [user("Read this:", None, "What does it say?")]
    _, ids = loaded.tokenizer.encode_chat(messages)
    placed = ours.place(ids, [processed], loaded.tokenizer)
    full = f"\n\n{BOI}{'<image_soft_token>' * 16}<end_of_image>\n\n"
    replacement = full if not processed.cols else (
        f"Here is the original image {full} and here are some crops to help you see better "
        + " ".join([full] * processed.cols))
    text = loaded.tokenizer.apply_chat_template(messages).replace(BOI, replacement)
    assert placed == tokenizer(text, add_special_tokens=False)["input_ids"]
    spans = image_spans([i for i, t in enumerate(placed) if t == loaded.module.vision.image_token_id])
    assert [end - start for start, end in spans] == [16] * (1 + processed.cols)
    if processed.cols:  # every tile's embeddings where its tokens are: the prompt scores as transformers' does
        expected_logprobs, generated, _, _ = reference_run(reference, loaded, placed, [processed], 3)
        engine = LLMEngine(EngineConfig(model=str(loaded.path), quantization="none", max_model_len=512,
                                        kv_cache_memory_gib=0.01), loaded=loaded)
        got, tokens, _ = engine_run(engine, "p", placed, [processed], 3)
        torch.testing.assert_close(got, expected_logprobs, atol=2e-5, rtol=0)
        assert tokens == generated
    assert dataclasses.replace(ours, pan_and_scan=None).process(data).cols == 0


def test_pan_and_scan_is_turned_on_at_load_and_only_for_gemma3(model_dir, tmp_path, tiny_hf_dir):
    from model.errors import ModelLoadError
    from model.image_processor import PanAndScan

    assert load(model_dir).module.vision.processor.pan_and_scan is None  # the checkpoint's setting: off
    assert load(model_dir, pan_and_scan=True).module.vision.processor.pan_and_scan == PanAndScan()
    from tiny_models import write_gemma3_vision_gguf

    write_gemma3_vision_gguf(model_dir, tmp_path / "text.gguf", tmp_path / "mmproj.gguf")
    files = load(tmp_path / "text.gguf", mmproj=tmp_path / "mmproj.gguf", pan_and_scan=True)
    assert files.module.vision.processor.pan_and_scan == PanAndScan()
    with pytest.raises(ModelLoadError, match="reads none"):
        load(tiny_hf_dir("llama3"), pan_and_scan=True)
