"""Images through a vision model (model/vision.py, model/image_processor.py), against transformers on the
same weights: a tiny random SmolVLM (Idefics3) whose tiles are 64 pixels, images resized to 128 first.

The tiles equal transformers' image processor's, the prompt ids its processor's, and the engine's
log-probabilities of every prompt token and its greedy tokens equal Idefics3ForConditionalGeneration's, in
one prefill or in chunks that cut the image's tokens anywhere; the prefix cache tells images apart."""

from __future__ import annotations

import json

import pytest
import torch
from random_images import png

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from model.image_processor import ImageError
from model.loader import load
from model.precision import cpu_multiplies_bf16, resolve_vision_dtype

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

TEXT = "<|im_start|>User:<image>What is in the picture?<end_of_utterance>\nAssistant:"
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    from tiny_models import make_tiny_vision_model

    return make_tiny_vision_model(tmp_path_factory.mktemp("models") / "tiny-smolvlm")


@pytest.fixture(scope="module")
def loaded(vision_dir):
    return load(vision_dir, vision_dtype="float32")  # the checkpoint's own arithmetic, for exact parity


@pytest.fixture(scope="module")
def reference(vision_dir):
    from transformers import Idefics3ForConditionalGeneration, Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    config = json.loads((vision_dir / "preprocessor_config.json").read_text())
    config.pop("image_processor_type")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(vision_dir / "tokenizer.json"))
    processor = Idefics3Processor(Idefics3ImageProcessorPil(**config), tokenizer=tokenizer, image_seq_len=16)
    return processor, Idefics3ForConditionalGeneration.from_pretrained(vision_dir).eval()


def prompt_ids(loaded, data: bytes, messages: list[dict] = MESSAGES) -> tuple[list[int], object]:
    """The chat's ids with the image's placeholder, as the server builds them (server/images.py)."""
    vision = loaded.module.vision
    image = vision.processor.process(data)
    _, ids = loaded.tokenizer.encode_chat(messages)
    return vision.processor.place(ids, [image], loaded.tokenizer), image


@pytest.mark.parametrize("size", [(90, 150), (150, 40), (64, 64), (20, 30), (300, 200)])
def test_tiles_and_prompt_ids_equal_the_checkpoints_processor(loaded, reference, size):
    processor, _ = reference
    data, image = png(*size, seed=sum(size))
    ids, processed = prompt_ids(loaded, data)
    expected = processor(images=[image], text=TEXT, return_tensors="pt")
    assert torch.equal(processed.pixels, expected["pixel_values"][0])
    assert ids == expected["input_ids"][0].tolist()
    tiles = 1 + processed.rows * processed.cols if processed.rows else 1
    assert processed.pixels.shape == (tiles, 3, 64, 64)


def test_transparent_and_grey_images_read_as_the_checkpoints_processor_reads_them(loaded, reference):
    processor, _ = reference
    for mode in ("RGBA", "L"):
        data, image = png(70, 50, seed=3, mode=mode)
        expected = processor(images=[image], text=TEXT, return_tensors="pt")["pixel_values"][0]
        assert torch.equal(loaded.module.vision.processor.process(data).pixels, expected)


def run(engine: LLMEngine, ids: list[int], images, params: SamplingParams, request_id: str):
    engine.add_request(request_id, ids, params, images=images)
    deltas = []
    while engine.has_unfinished():
        deltas += [d for d in engine.step() if d.request_id.startswith(request_id)]
    return deltas


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 24])
def test_prompt_logprobs_and_greedy_tokens_equal_transformers(loaded, reference, max_num_batched_tokens):
    """24-token chunks cut the image's 80 tokens (4 tiles and the global one, 16 each) in many places."""
    processor, model = reference
    data, image = png(90, 150, seed=1)
    ids, processed = prompt_ids(loaded, data)
    engine = LLMEngine(EngineConfig(model=str(loaded.path), quantization="none", enable_prefix_caching=False,
                                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=512,
                                    kv_cache_memory_gib=0.01), loaded=loaded)
    deltas = run(engine, ids, engine.encode_images([processed]), SamplingParams(max_tokens=6, temperature=0,
                                                                                prompt_logprobs=0), "a")
    inputs = processor(images=[image], text=TEXT, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
        generated = model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    scored = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs)
    got = torch.tensor([entry.logprob for entry in scored if entry is not None])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    assert [t for d in deltas for t in d.token_ids] == generated
    # The image matters: the same ids over the image token's own embedding score differently after it.
    with torch.no_grad():
        blind = torch.log_softmax(model.model.text_model(input_ids=inputs["input_ids"]).last_hidden_state[0]
                                  @ model.lm_head.weight.T, -1)
    first = ids.index(loaded.module.vision.image_token_id)
    assert (blind[first + 1:-1].max(-1).indices != logits[first + 1:-1].argmax(-1)).any()


def test_the_prefix_cache_tells_images_apart(loaded):
    """Blocks before the first image token are text, shared by any image; from the block that holds it on,
    a block is found only by a request with the same images."""
    engine = LLMEngine(EngineConfig(model=str(loaded.path), quantization="none", max_model_len=512,
                                    kv_cache_memory_gib=0.01, block_size=16), loaded=loaded)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1)
    system = {"role": "system", "content": [{"type": "text", "text": "You describe pictures for people who "
                                                                    "cannot see them, plainly and briefly."}]}
    first, image_a = prompt_ids(loaded, png(90, 150, seed=1)[0], [system, *MESSAGES])
    second, image_b = prompt_ids(loaded, png(90, 150, seed=2)[0], [system, *MESSAGES])
    assert first == second  # the same prompt ids: only the pixels differ
    text_blocks = first.index(loaded.module.vision.image_token_id) // 16
    assert text_blocks >= 1
    a = run(engine, first, engine.encode_images([image_a]), params, "a")
    again = run(engine, first, engine.encode_images([image_a]), params, "again")
    b = run(engine, second, engine.encode_images([image_b]), params, "b")
    assert again[0].num_cached_tokens == (len(first) - 1) // 16 * 16  # every full block but the last token's
    assert b[0].num_cached_tokens == text_blocks * 16  # the text before the image only
    assert [t for d in again for t in d.token_ids] == [t for d in a for t in d.token_ids]
    assert a[0].logprobs[0].logprob != b[0].logprobs[0].logprob


def test_image_tokens_and_embeddings_must_agree(loaded):
    engine = LLMEngine(EngineConfig(model=str(loaded.path), quantization="none", max_model_len=512,
                                    kv_cache_memory_gib=0.01), loaded=loaded)
    ids, image = prompt_ids(loaded, png(90, 150, seed=1)[0])
    encoded = engine.encode_images([image])
    with pytest.raises(ValueError, match="80 image tokens and its images 0 embeddings"):
        engine.add_request("x", ids, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="2 image tokens and its images 80"):
        engine.add_request("y", [1, 2, loaded.module.vision.image_token_id] * 2, SamplingParams(max_tokens=1),
                           images=encoded)


def test_a_model_without_a_vision_tower_takes_no_images(tiny_dir, loaded):
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), max_model_len=128, kv_cache_memory_gib=0.01))
    assert engine.vision is None
    with pytest.raises(ValueError, match="takes no images"):
        engine.encode_images([])
    other = loaded.module.vision.encode([loaded.module.vision.processor.process(png(64, 64, seed=0)[0])])
    with pytest.raises(ValueError, match="takes no images"):
        engine.add_request("z", [1, 2, 3], SamplingParams(max_tokens=1), images=other)


@pytest.mark.parametrize("data, message", [
    (b"not an image", "not a readable image"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "not a readable image"),
])
def test_bytes_that_are_not_an_image_are_refused(loaded, data, message):
    with pytest.raises(ImageError, match=message):
        loaded.module.vision.processor.process(data)


def test_a_huge_image_is_refused_before_it_is_decoded(loaded, monkeypatch):
    from model import image_processor

    monkeypatch.setattr(image_processor, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageError, match="at most 100"):
        loaded.module.vision.processor.process(png(20, 20, seed=0)[0])


def test_images_in_w8a8_layers_run_as_one_cpp_call_a_step_as_in_the_eager_layers(vision_dir, loaded):
    """The CPU default for a float32 directory: W8A8 text layers, which run as one C++ call a step
    (model/cpu_step.py); an image's rows go in before it, so its results are the eager layers' bits."""
    quantized = load(vision_dir, quantization="w8a8", vision_dtype="float32")
    ids, image = prompt_ids(quantized, png(90, 150, seed=1)[0])
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)
    results = []
    for use_cpu_step in (True, False):
        quantized.module.use_cpu_step = use_cpu_step
        engine = LLMEngine(EngineConfig(model=str(vision_dir), quantization="w8a8", max_model_len=512,
                                        kv_cache_memory_gib=0.01, enable_prefix_caching=False), loaded=quantized)
        deltas = run(engine, ids, engine.encode_images([image]), params, "q")
        scored = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs)
        results.append(([t for d in deltas for t in d.token_ids], [e.logprob for e in scored if e is not None]))
        if use_cpu_step:
            assert quantized.module.cpu_step_reason is None  # the C++ step ran
    assert results[0] == results[1]


def test_ladder_generate_shows_the_model_an_image(vision_dir, loaded, tiny_dir, tmp_path, capsys):
    from ladder.cli import main

    data, _ = png(90, 150, seed=1)
    (tmp_path / "pic.png").write_bytes(data)
    ids, image = prompt_ids(loaded, data)
    engine = LLMEngine(EngineConfig(model=str(vision_dir), quantization="none", max_model_len=512,
                                    kv_cache_memory_gib=0.01), loaded=loaded)
    expected = "".join(d.text for d in run(engine, ids, engine.encode_images([image]),
                                            SamplingParams(max_tokens=6, temperature=0), "cli"))
    assert main(["generate", "What is in the picture?", "--model", str(vision_dir), "--image",
                 str(tmp_path / "pic.png"), "--max-tokens", "6", "--quantization", "none", "--vision-dtype",
                 "float32"]) == 0
    out, err = capsys.readouterr()
    assert out == expected + "\n" and f"prompt {len(ids)} tokens" in err
    for args, message in ((["--model", str(tiny_dir), "--image", str(tmp_path / "pic.png")], "takes no images"),
                          (["--model", str(vision_dir), "--image", str(tmp_path / "none.png")], "No such file"),
                          (["--model", str(vision_dir), "--image", str(tmp_path / "pic.png"), "--raw"], "drop --raw")):
        assert main(["generate", "Hi", "--quantization", "none", *args]) == 1
        assert message in capsys.readouterr().err


def test_a_bfloat16_tower_stays_close_to_float32(vision_dir, loaded):
    """`--vision-dtype auto` runs a float32 model's tower in bfloat16 on a CPU that multiplies bfloat16 in
    hardware; its embeddings, and the prompt's log-probabilities after them, stay near float32's."""
    assert resolve_vision_dtype("auto", torch.float32, "cpu") == (torch.bfloat16 if cpu_multiplies_bf16()
                                                                   else torch.float32)
    assert resolve_vision_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert resolve_vision_dtype("float32", torch.float32, "cpu") == torch.float32
    half = load(vision_dir, vision_dtype="bfloat16")
    assert half.module.vision.encoder.dtype == torch.bfloat16
    image = loaded.module.vision.processor.process(png(90, 150, seed=1)[0])
    exact, rounded = loaded.module.vision.encode([image]).embeds, half.module.vision.encode([image]).embeds
    assert rounded.dtype == torch.bfloat16
    assert (rounded.float() - exact).norm() / exact.norm() < 0.02
    ids, _ = prompt_ids(loaded, png(90, 150, seed=1)[0])
    scores = []
    for model in (loaded, half):
        engine = LLMEngine(EngineConfig(model=str(vision_dir), quantization="none", max_model_len=512,
                                        kv_cache_memory_gib=0.01), loaded=model)
        deltas = run(engine, ids, engine.encode_images([image]), SamplingParams(max_tokens=1, prompt_logprobs=0), "h")
        scored = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs)
        scores.append(torch.tensor([e.logprob for e in scored if e is not None]))
    assert (scores[0] - scores[1]).abs().max() < 0.05


def test_a_gguf_text_model_with_llama_cpps_projector_file_reads_images_as_the_directory_does(vision_dir, loaded,
                                                                                            tmp_path):
    """`--mmproj`: llama.cpp's SmolVLM files (a llama GGUF and a `clip` projector of type idefics3, written
    here as its converter writes them) give the same prompt ids, tiles, embeddings and tokens as the Hugging
    Face directory they came from."""
    from tiny_models import write_vision_gguf

    write_vision_gguf(vision_dir, tmp_path / "text.gguf", tmp_path / "mmproj.gguf")
    gguf_model = load(tmp_path / "text.gguf", mmproj=tmp_path / "mmproj.gguf", vision_dtype="float32")
    data = png(90, 150, seed=1)[0]
    (ids, image), (gguf_ids, gguf_image) = prompt_ids(loaded, data), prompt_ids(gguf_model, data)
    assert gguf_ids == ids and torch.equal(gguf_image.pixels, image.pixels)
    encoded = loaded.module.vision.encode([image])
    assert torch.equal(gguf_model.module.vision.encode([gguf_image]).embeds, encoded.embeds)
    tokens = []
    for model in (loaded, gguf_model):
        engine = LLMEngine(EngineConfig(model=str(model.path), quantization="none", max_model_len=512,
                                        kv_cache_memory_gib=0.01), loaded=model)
        tokens.append([t for d in run(engine, ids, engine.vision.encode([image]),
                                      SamplingParams(max_tokens=6, temperature=0), "g") for t in d.token_ids])
    assert tokens[0] == tokens[1]


def test_projector_files_that_do_not_fit_are_refused(vision_dir, tiny_dir, tmp_path):
    from tiny_models import write_vision_gguf

    from model.errors import ModelLoadError

    write_vision_gguf(vision_dir, tmp_path / "text.gguf", tmp_path / "mmproj.gguf")
    with pytest.raises(ModelLoadError, match="not a multimodal projector file"):
        load(tmp_path / "text.gguf", mmproj=tmp_path / "text.gguf")  # the text model given as the projector
    with pytest.raises(ValueError, match="--mmproj goes with a GGUF text model"):
        load(vision_dir, mmproj=tmp_path / "mmproj.gguf")
    with pytest.raises(ModelLoadError, match="no <image> token"):
        load(default_gguf(), mmproj=tmp_path / "mmproj.gguf")  # SmolLM2 alone: no image tokens
    (tmp_path / "junk.gguf").write_bytes(b"GGUF junk")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load(tmp_path / "text.gguf", mmproj=tmp_path / "junk.gguf")


def default_gguf():
    from model.default import default_model_path

    return default_model_path()


def test_llm_chat_takes_images_as_bytes_paths_or_data_urls(vision_dir, loaded, tiny_dir, tmp_path):
    import base64

    from engine.llm import LLM

    data = png(90, 150, seed=1)[0]
    (tmp_path / "pic.png").write_bytes(data)
    ids, image = prompt_ids(loaded, data)
    llm = LLM(loaded=loaded, quantization="none", max_model_len=512, kv_cache_memory_gib=0.01)
    params = SamplingParams(max_tokens=6, temperature=0)
    expected = [t for d in run(llm.engine, ids, llm.engine.encode_images([image]), params, "x") for t in d.token_ids]
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in ({"type": "image", "image": data}, {"type": "image", "image": str(tmp_path / "pic.png")},
                   {"type": "image_url", "image_url": {"url": url}}):
        messages = [{"role": "user", "content": [source, {"type": "text", "text": "What is in the picture?"}]}]
        output = llm.chat(messages, params)
        assert output.prompt_token_ids == ids and output.outputs[0].token_ids == expected
    text_model = LLM(model=str(tiny_dir), max_model_len=128, kv_cache_memory_gib=0.01)
    with pytest.raises(ValueError, match="takes no images"):
        text_model.chat([{"role": "user", "content": [{"type": "image", "image": data}]}], params)


def test_an_image_sent_again_skips_the_tower(loaded, monkeypatch):
    """Every turn of a chat about a picture sends it again: its embeddings come from the engine's image cache
    (least recently used out, within its bytes), equal to the tower's."""
    from engine.image_cache import ImageCache

    engine = LLMEngine(EngineConfig(model=str(loaded.path), quantization="none", max_model_len=512,
                                    kv_cache_memory_gib=0.01), loaded=loaded)
    vision = loaded.module.vision
    a, b = vision.processor.process(png(90, 150, seed=1)[0]), vision.processor.process(png(64, 64, seed=2)[0])
    tiles = []
    forward = vision.encoder.forward
    monkeypatch.setattr(vision.encoder, "forward", lambda pixels: tiles.append(pixels.shape[0]) or forward(pixels))
    first = engine.encode_images([a, b])
    again = engine.encode_images([b, a, a])
    assert tiles == [10]  # 5 tiles each, in one run; the second request ran no tower
    assert torch.equal(first.embeds, vision.encode([a, b]).embeds)
    assert torch.equal(again.embeds, torch.cat([first.embeds[80:], first.embeds[:80], first.embeds[:80]]))
    assert (engine.image_cache.hits, engine.image_cache.misses) == (3, 2)

    def encoded(cache: ImageCache, images: list, tiles_per_piece: int) -> list[torch.Tensor]:
        encoding = cache.start(images, forward, 16)
        while not encoding.done:
            encoding.advance(tiles_per_piece)
        return encoding.result()

    one_image = first.embeds[:80].numel() * 4  # each image here is 5 tiles, 80 rows of 32 floats
    small = ImageCache(max_bytes=one_image + one_image // 2)
    pieces = encoded(small, [a, b], 3)  # 3 tiles a piece: pieces cut across the two images
    assert torch.equal(torch.cat(pieces), first.embeds)  # the same as one run over every tile
    assert list(small.entries) == [b.digest] and small.num_bytes == one_image  # a, the least recent, went
    none_fit = ImageCache(max_bytes=one_image - 1)  # no image fits: none is kept, each is still encoded
    assert torch.equal(encoded(none_fit, [a], 1)[0], first.embeds[:80]) and not none_fit.entries
