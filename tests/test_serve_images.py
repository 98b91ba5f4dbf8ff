"""`openm3 serve` with images: a tiny random vision-language model answers image requests in the three chat formats
(OpenAI Chat Completions, OpenAI Responses, Anthropic Messages), with the prompt training would write for the same
conversation and the images' patches reaching the engine; bad image parts, URLs and text-only models get 400s
naming the part."""

import base64
import io
import sys

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

import test_serve
from openm3.data.chat import render_segments
from openm3.data.packing import Example, tokenize_example
from openm3.engine import BatchedGenerator, PromptImages, generate
from openm3.models import M3ForConditionalGeneration, M3VLConfig
from openm3.models.processor import M3ImageProcessor
from openm3.serve import ModelBackend, create_app
from openm3.serve.cli import build_app, build_parser
from openm3.train.data import processor_layout
from test_serve import NAME, named_events

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

tok, model = test_serve.tok, test_serve.model  # module-scoped fixtures: the test tokenizer, a text-only model
LIMIT = 128
QUESTION = "What is in this picture?"


def png_base64(h: int = 40, w: int = 60, seed: int = 0) -> tuple[np.ndarray, str]:
    """A random RGB image and its PNG as base64; 40 x 60 is resized to 56 x 84: grid (1, 4, 6), 6 visual tokens."""
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return pixels, base64.b64encode(buf.getvalue()).decode()


PIXELS, B64 = png_base64()
DATA_URL = f"data:image/png;base64,{B64}"


def chat_body(url: str = DATA_URL, text: str = QUESTION) -> dict:
    return {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]}


def responses_body(url: str = DATA_URL) -> dict:
    return {"max_output_tokens": 4, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": url}]}]}


def anthropic_body(source: dict | None = None) -> dict:
    source = source or {"type": "base64", "media_type": "image/png", "data": B64}
    return {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                                                       {"type": "image", "source": source}]}]}


ENDPOINTS = {"chat": ("/v1/chat/completions", chat_body), "responses": ("/v1/responses", responses_body),
             "anthropic": ("/v1/messages", anthropic_body)}


def answer_text(kind: str, body: dict) -> str:
    if kind == "chat":
        return body["choices"][0]["message"]["content"]
    if kind == "responses":
        return body["output"][0]["content"][0]["text"]
    return body["content"][0]["text"]


@pytest.fixture(scope="module")
def vl(tok):
    """A tiny random VL model over the test tokenizer (placeholder ids its own): MSA + MoE text, m3-tiny tower."""
    torch.manual_seed(0)
    config = M3VLConfig.from_name("m3-tiny", image_token_index=tok.image_id, video_token_index=tok.video_id,
                                  vocab_size=tok.vocab_size, num_hidden_layers=2,
                                  layer_types=["full_attention", "minimax_m3_sparse"],
                                  mlp_layer_types=["dense", "sparse"], index_topk_blocks=2,
                                  max_position_embeddings=256)
    return M3ForConditionalGeneration(config).eval()


class Recording(ModelBackend):
    """`ModelBackend` that keeps the prompts and images it was given."""

    def __init__(self, model):
        super().__init__(model)
        self.calls = []

    def __call__(self, prompt, **kwargs):
        self.calls.append((list(prompt), kwargs.get("images")))
        return super().__call__(prompt, **kwargs)


@pytest.fixture(scope="module")
def backend(vl):
    return Recording(vl)


@pytest.fixture(scope="module")
def text_client(model, tok):
    return TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=LIMIT))


@pytest.fixture(scope="module")
def client(backend, tok):
    return TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=LIMIT))


def training_prompt(tok) -> list[int]:
    """The same conversation as the training data pipeline tokenizes it (template, processor's placeholders)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}]
    example = Example(render_segments(messages, add_generation_prompt=True), [PIXELS])
    return tokenize_example(example, tok, processor_layout).input_ids.tolist()


@pytest.mark.parametrize("kind", list(ENDPOINTS))
def test_an_image_request_reaches_the_engine_with_its_placeholders(client, backend, vl, tok, kind):
    path, body = ENDPOINTS[kind]
    before = len(backend.calls)
    r = client.post(path, json={"model": NAME, "temperature": 0, **body()})
    assert r.status_code == 200, r.text
    (prompt, images), = backend.calls[before:]
    assert prompt == training_prompt(tok)
    assert prompt.count(tok.image_id) == 6 and images.grid_thw.tolist() == [[1, 4, 6]]
    pixels, grid = M3ImageProcessor()([PIXELS])
    assert torch.equal(images.pixel_values, pixels) and torch.equal(images.grid_thw, grid)
    results, _ = generate(vl, [prompt], max_new_tokens=4, stop_tokens=[tok.eos_id], images=[(pixels, grid)])
    want = tok.decode([t for t in results[0].tokens if t != tok.eos_id])
    assert answer_text(kind, r.json()) == want


def test_anthropic_count_tokens_counts_the_placeholders(client, tok):
    r = client.post("/v1/messages/count_tokens", json={"model": NAME, **anthropic_body()})
    assert r.status_code == 200 and r.json()["input_tokens"] == len(training_prompt(tok))


def test_batching_backend_answers_images_streamed_or_not_and_text_beside_them(vl, tok):
    batcher = BatchedGenerator(vl, token_budget=512, max_batch=4, chunk_size=16)
    client = TestClient(create_app(batcher, tok, model_name=NAME, max_total_tokens=LIMIT))
    plain = client.post("/v1/messages", json={"model": NAME, "temperature": 0, **anthropic_body()}).json()
    results, _ = generate(vl, [training_prompt(tok)], max_new_tokens=4, stop_tokens=[tok.eos_id],
                          images=[M3ImageProcessor()([PIXELS])])
    assert plain["content"][0]["text"] == tok.decode([t for t in results[0].tokens if t != tok.eos_id])
    chunks = named_events(client.post("/v1/messages", json={"model": NAME, "temperature": 0, "stream": True,
                                                            **anthropic_body()}))
    text = "".join(c["delta"]["text"] for c in chunks if c["type"] == "content_block_delta")
    assert text == plain["content"][0]["text"]
    r = client.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 3, "messages": [
        {"role": "user", "content": "no picture"}]})
    assert r.status_code == 200, r.text
    batcher.close()


def test_cli_serves_vision_presets_and_vl_checkpoints(vl, tok, tmp_path):
    path = str(tok.save(tmp_path / "tok"))
    preset = build_app(build_parser().parse_args(["--preset", "m3-tiny", "--vision", "--tokenizer", path,
                                                  "--max-total-tokens", "128", "--max-batch", "1"]))
    vl.save_pretrained(tmp_path / "ckpt")
    tok.save(tmp_path / "ckpt")
    checkpoint = build_app(build_parser().parse_args(["--checkpoint", str(tmp_path / "ckpt"),
                                                      "--max-total-tokens", "128"]))
    for app, name in ((preset, "m3-tiny"), (checkpoint, "ckpt")):
        r = TestClient(app).post("/v1/chat/completions", json={**chat_body(), "model": name})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(training_prompt(tok))
    with pytest.raises(ValueError, match="--vision: only with --preset"):
        build_app(build_parser().parse_args(["--checkpoint", str(tmp_path / "ckpt"), "--vision"]))


def _error(r) -> str:
    body = r.json()
    return body["error"]["message"]


BAD = [  # (id, endpoint, body, message)
    ("bad-base64", "chat", chat_body("data:image/png;base64,not base64!"),
     "messages[0].content[1]: the image data is not valid base64"),
    ("not-an-image", "chat", chat_body("data:image/png;base64," + base64.b64encode(b"hello").decode()),
     "messages[0].content[1]: the data is not an image Pillow can read"),
    ("http-url", "chat", chat_body("https://example.com/cat.png"),
     "messages[0].content[1].image_url.url: only data URLs (data:image/png;base64,...) are accepted"),
    ("not-base64-url", "chat", chat_body("data:image/png," + B64),
     "messages[0].content[1].image_url.url: expected base64 data in the data URL"),
    ("text-media-type", "chat", chat_body("data:text/plain;base64," + B64),
     "messages[0].content[1].image_url.url: expected an image media type"),
    ("marker-in-text", "chat", chat_body(text="look: ]<]image[>["), "content: the text may not contain the marker"),
    ("too-many-tokens", "chat", {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_base64(336, 336)[1]}"}}]}]},
     "configured maximum"),
    ("responses-http-url", "responses", responses_body("http://example.com/cat.png"),
     "input[0].content[1].image_url: only data URLs"),
    ("responses-bad-base64", "responses", responses_body("data:image/png;base64,%%%"),
     "input[0].content[1]: the image data is not valid base64"),
    ("anthropic-url-source", "anthropic", anthropic_body({"type": "url", "url": "https://example.com/cat.png"}),
     "messages[0].content[1].source.type: only base64 sources are accepted"),
    ("anthropic-bad-base64", "anthropic", anthropic_body({"type": "base64", "media_type": "image/png", "data": "@"}),
     "messages[0].content[1].source: the image data is not valid base64"),
]


@pytest.mark.parametrize("kind,body,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_image_parts_get_a_400_naming_the_part(client, kind, body, message):
    r = client.post(ENDPOINTS[kind][0], json={"model": NAME, **body})
    assert r.status_code == 400, r.text
    got = _error(r)
    assert message in got, got
    if kind != "anthropic":
        assert r.json()["error"]["param"] == ("input" if kind == "responses" else "messages")


@pytest.mark.parametrize("kind", list(ENDPOINTS))
def test_a_text_only_model_refuses_images_by_part(text_client, kind):
    path, body = ENDPOINTS[kind]
    r = text_client.post(path, json={"model": NAME, **body()})
    assert r.status_code == 400, r.text
    where = "input[0].content[1]" if kind == "responses" else "messages[0].content[1]"
    assert f"{where}: " in _error(r) and "not supported by this server (text-only model)" in _error(r)


def test_missing_pillow_is_a_clear_400(client, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # `from PIL import Image` raises ImportError
    r = client.post("/v1/chat/completions", json={"model": NAME, **chat_body()})
    assert r.status_code == 400 and "Pillow is not installed" in _error(r)


def test_the_tokenizer_must_share_the_image_placeholder(tok):
    torch.manual_seed(0)
    config = M3VLConfig.from_name("m3-tiny", image_token_index=tok.image_id + 1, video_token_index=tok.video_id + 1,
                                  num_hidden_layers=1, layer_types=["full_attention"], mlp_layer_types=["dense"])
    with pytest.raises(ValueError, match="image_token_index"):
        create_app(ModelBackend(M3ForConditionalGeneration(config)), tok, model_name=NAME, max_total_tokens=64)


def tool_result_body(result: list | str, is_error: bool = False) -> dict:
    """A tool round trip whose result is a screenshot: the assistant called `screenshot`, the user returns it."""
    return {"max_tokens": 4, "messages": [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result,
                                      **({"is_error": True} if is_error else {})}]}]}


def test_anthropic_tool_result_images_reach_the_engine(client, backend, tok):
    """A tool_result may carry image blocks (a screenshot an agent's tool took): the tool message holds the text
    and the image in order, prompt and patches as the training pipeline writes the same conversation."""
    source = {"type": "base64", "media_type": "image/png", "data": B64}
    result = [{"type": "text", "text": "Here it is:"}, {"type": "image", "source": source}]
    for is_error, prefix in ((False, ""), (True, "Error: ")):
        before = len(backend.calls)
        r = client.post("/v1/messages", json={"model": NAME, "temperature": 0, **tool_result_body(result, is_error)})
        assert r.status_code == 200, r.text
        (prompt, images), = backend.calls[before:]
        messages = [{"role": "user", "content": "Take a screenshot."},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "toolu_1", "type": "function", "function": {"name": "screenshot", "arguments": {}}}]},
                    {"role": "tool", "tool_call_id": "toolu_1",
                     "content": [{"type": "text", "text": prefix + "Here it is:"}, {"type": "image"}]}]
        example = Example(render_segments(messages, add_generation_prompt=True), [PIXELS])
        assert prompt == tokenize_example(example, tok, processor_layout).input_ids.tolist()
        assert images.grid_thw.tolist() == [[1, 4, 6]]
        assert torch.equal(images.pixel_values, M3ImageProcessor()([PIXELS])[0])
    # a text-only result renders as before: the string form and the one-text-block form give one prompt
    for content in ("done", [{"type": "text", "text": "done"}]):
        before = len(backend.calls)
        assert client.post("/v1/messages", json={"model": NAME, **tool_result_body(content)}).status_code == 200
        (prompt, images), = backend.calls[before:]
        assert images is None
        if content == "done":
            text_prompt = prompt
    assert prompt == text_prompt


def test_anthropic_tool_result_bad_blocks_get_a_400_naming_them(client, text_client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    where = "messages[2].content[0].content[1]"
    r = text_client.post("/v1/messages", json={"model": NAME, **tool_result_body([{"type": "text", "text": "x"},
                                                                                  image])})
    assert r.status_code == 400 and f"{where}: image blocks are not supported by this server" in _error(r), r.text
    bad = {"type": "image", "source": {"type": "url", "url": "https://example.com/shot.png"}}
    r = client.post("/v1/messages", json={"model": NAME, **tool_result_body([{"type": "text", "text": "x"}, bad])})
    assert r.status_code == 400 and f"{where}.source.type: only base64 sources" in _error(r), r.text
    r = client.post("/v1/messages", json={"model": NAME, **tool_result_body([{"type": "audio"}])})
    assert r.status_code == 400 and "messages[2].content[0].content[0]: expected a text block" in _error(r), r.text
    r = client.post("/v1/messages", json={"model": NAME, **tool_result_body([{"type": "document"}])})  # no source
    assert r.status_code == 400 and "messages[2].content[0].content[0].source: expected a document source" in _error(r)


def apng_base64(frames: np.ndarray, frame_ms: int) -> str:
    """Frames uint8 [F, H, W, 3] as an animated PNG (lossless, so the server decodes exactly these), base64."""
    buf = io.BytesIO()
    first, *rest = [Image.fromarray(f) for f in frames]
    first.save(buf, format="PNG", save_all=True, append_images=rest, duration=frame_ms, loop=0)
    return base64.b64encode(buf.getvalue()).decode()


FRAMES = np.random.default_rng(7).integers(0, 256, (5, 56, 56, 3), dtype=np.uint8)


def video_body(url: str, text: str = "What happens?") -> dict:
    return {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "video_url", "video_url": {"url": url}}]}]}


def test_a_video_request_reaches_the_engine_as_training_writes_it(client, backend, vl, tok):
    """vLLM's `video_url` part with an animated PNG (5 frames at 2 fps): the prompt is the training pipeline's for
    the same conversation and video (placeholder runs per temporal patch, with their timestamps), the patches are
    M3VideoProcessor's, and the answer is what `generate` gives for them."""
    from openm3.data.packing import Video
    from openm3.models.processor import M3VideoProcessor

    before = len(backend.calls)
    url = f"data:image/png;base64,{apng_base64(FRAMES, 500)}"
    r = client.post("/v1/chat/completions", json={"model": NAME, "temperature": 0, **video_body(url)})
    assert r.status_code == 200, r.text
    (prompt, visual), = backend.calls[before:]
    messages = [{"role": "user", "content": [{"type": "text", "text": "What happens?"}, {"type": "video"}]}]
    example = Example(render_segments(messages, add_generation_prompt=True), videos=[Video(FRAMES, fps=2.0)])
    assert prompt == tokenize_example(example, tok, processor_layout).input_ids.tolist()
    pixels, grid, _ = M3VideoProcessor()([FRAMES])
    assert visual.pixel_values is None and torch.equal(visual.pixel_values_videos, pixels)
    assert torch.equal(visual.video_grid_thw, grid) and prompt.count(tok.video_id) == 12  # 3 runs of 2x2
    results, _ = generate(vl, [prompt], max_new_tokens=4, stop_tokens=[tok.eos_id], images=[visual])
    assert r.json()["choices"][0]["message"]["content"] == tok.decode([t for t in results[0].tokens
                                                                        if t != tok.eos_id])


def test_the_checkpoint_clip_length_reaches_the_video_processor(vl, tok, tmp_path):
    """`create_app(video_frames_per_clip=)` cuts request videos into clips of that many temporal patches (the
    prompt is unchanged); `openm3 serve --checkpoint` reads it from the checkpoint's video processor config and
    names that file when it is bad, before loading any weights."""
    from openm3.models.processor import VIDEO_PROCESSOR_CONFIG, M3VideoProcessor

    backend = Recording(vl)
    url = f"data:image/png;base64,{apng_base64(FRAMES, 500)}"
    grids = []
    for clip in (1, None):
        app = create_app(backend, tok, model_name=NAME, max_total_tokens=LIMIT, video_frames_per_clip=clip)
        r = TestClient(app).post("/v1/chat/completions", json={"model": NAME, **video_body(url)})
        assert r.status_code == 200, r.text
        grids.append(backend.calls[-1][1].video_grid_thw)
        assert torch.equal(grids[-1], M3VideoProcessor(frames_per_clip=clip)([FRAMES])[1])
    assert backend.calls[0][0] == backend.calls[1][0] and grids[0][:, 0].tolist() == [1, 1, 1]
    assert grids[1][:, 0].tolist() == [3]
    with pytest.raises(ValueError, match="video_frames_per_clip: expected a positive int"):
        create_app(backend, tok, model_name=NAME, max_total_tokens=LIMIT, video_frames_per_clip=0)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / VIDEO_PROCESSOR_CONFIG).write_text('{"vision_segment_max_frames": "four"}')
    with pytest.raises(ValueError, match=f"{VIDEO_PROCESSOR_CONFIG}: vision_segment_max_frames: expected"):
        build_app(build_parser().parse_args(["--checkpoint", str(tmp_path / "ckpt")]))  # no weights there


def test_batching_backend_answers_a_video_beside_an_image(vl, tok):
    """The server's default backend (continuous batching) with a video request and an image request in flight
    together: each answer is `generate`'s for its prompt alone."""
    import threading

    from openm3.data.packing import Video
    from openm3.models.processor import M3VideoProcessor

    batcher = BatchedGenerator(vl, token_budget=512, max_batch=4, chunk_size=16)
    client = TestClient(create_app(batcher, tok, model_name=NAME, max_total_tokens=LIMIT))
    url = f"data:image/png;base64,{apng_base64(FRAMES, 500)}"
    bodies = {"video": {"model": NAME, "temperature": 0, **video_body(url)},
              "image": {"model": NAME, "temperature": 0, **chat_body()}}
    answers = {}

    def ask(kind):
        answers[kind] = client.post("/v1/chat/completions", json=bodies[kind]).json()["choices"][0]["message"]

    threads = [threading.Thread(target=ask, args=(kind,)) for kind in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close()
    video = PromptImages(None, None, *M3VideoProcessor()([FRAMES])[:2])
    messages = {"video": [{"type": "text", "text": "What happens?"}, {"type": "video"}],
                "image": [{"type": "text", "text": QUESTION}, {"type": "image"}]}
    for kind, images, media in (("video", video, ([], [Video(FRAMES, fps=2.0)])),
                                ("image", PromptImages(*M3ImageProcessor()([PIXELS])), ([PIXELS], []))):
        segments = render_segments([{"role": "user", "content": messages[kind]}], add_generation_prompt=True)
        prompt = tokenize_example(Example(segments, *media), tok, processor_layout).input_ids.tolist()
        results, _ = generate(vl, [prompt], max_new_tokens=4, stop_tokens=[tok.eos_id], images=[images])
        assert answers[kind]["content"] == tok.decode([t for t in results[0].tokens if t != tok.eos_id]), kind


def test_an_mp4_video_reaches_the_engine_as_its_decoded_frames_would(client, backend):
    """`data:video/mp4` (decoded by PyAV): the prompt and patches are those of the same frames sent losslessly as
    an animated PNG at the stream's rate (8 fps: 125 ms a frame)."""
    from test_video_decode import encode, whole_decode

    mp4 = encode(FRAMES, rate=8)
    frames = np.stack(whole_decode(mp4))
    calls = []
    for url in (f"data:video/mp4;base64,{base64.b64encode(mp4).decode()}",
                f"data:image/png;base64,{apng_base64(frames, 125)}"):
        r = client.post("/v1/chat/completions", json={"model": NAME, **video_body(url)})
        assert r.status_code == 200, r.text
        calls.append(backend.calls[-1])
    (mp4_prompt, mp4_visual), (png_prompt, png_visual) = calls
    assert mp4_prompt == png_prompt and torch.equal(mp4_visual.pixel_values_videos, png_visual.pixel_values_videos)
    assert torch.equal(mp4_visual.video_grid_thw, png_visual.video_grid_thw)


def test_long_videos_are_sampled_evenly():
    from openm3.engine.media import MAX_VIDEO_FRAMES, decode_video

    frames = np.random.default_rng(8).integers(0, 256, (MAX_VIDEO_FRAMES + 6, 28, 28, 3), dtype=np.uint8)
    got, meta = decode_video({"data": apng_base64(frames, 40), "where": "v"})
    assert got.shape == (MAX_VIDEO_FRAMES, 28, 28, 3) and meta.fps == 25.0
    assert meta.frames_indices[0] == 0 and meta.frames_indices[-1] == MAX_VIDEO_FRAMES + 5
    assert all(np.array_equal(got[i], frames[j]) for i, j in enumerate(meta.frames_indices))


def test_bad_video_parts_get_a_400_naming_the_part(client, text_client):
    jpeg = f"data:image/jpeg;base64,{B64}"
    r = client.post("/v1/chat/completions", json={"model": NAME, **video_body(jpeg)})
    assert r.status_code == 400 and "messages[0].content[1].video_url.url: videos are accepted as data URLs of a " \
        "video/* type (MP4, WebM, ...) or of an animated image/gif" in _error(r), r.text
    mp4 = "data:video/mp4;base64,AAAA"
    r = client.post("/v1/chat/completions", json={"model": NAME, **video_body(mp4)})
    assert r.status_code == 400 and "messages[0].content[1]: the data is neither an animation Pillow can read nor a " \
        "video PyAV can decode" in _error(r), r.text
    url = f"data:image/png;base64,{apng_base64(FRAMES, 500)}"
    r = text_client.post("/v1/chat/completions", json={"model": NAME, **video_body(url)})
    assert r.status_code == 400 and "messages[0].content[1]: 'video_url' parts are not supported by this server" \
        in _error(r), r.text
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {}}]}]})
    assert r.status_code == 400 and "'input_audio' parts are not supported" in r.text, r.text


def test_generate_cli_takes_image_and_video_files(vl, model, tok, tmp_path, capsys):
    """`openm3 generate --checkpoint VL --image F --video F --prompt TEXT`: one user turn (images, videos, text) as
    training writes it, and the tokens `generate` gives for that prompt and those patches."""
    from openm3.data.packing import Video
    from openm3.engine.generate import main
    from openm3.models.processor import M3VideoProcessor

    vl.save_pretrained(tmp_path / "ckpt")
    tok.save(tmp_path / "ckpt")
    (tmp_path / "cat.png").write_bytes(base64.b64decode(B64))
    (tmp_path / "clip.png").write_bytes(base64.b64decode(apng_base64(FRAMES, 500)))
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--prompt", QUESTION, "--image", str(tmp_path / "cat.png"),
            "--video", str(tmp_path / "clip.png"), "--max-new-tokens", "3", "--device", "cpu", "--no-stream"]
    assert main(argv) == 0
    printed = capsys.readouterr().out.strip()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text",
                                                                                   "text": QUESTION}]}]
    example = Example(render_segments(messages, add_generation_prompt=True), [PIXELS],
                      [Video(FRAMES, fps=2.0)])
    prompt = tokenize_example(example, tok, processor_layout).input_ids.tolist()
    images = PromptImages(*M3ImageProcessor()([PIXELS]), *M3VideoProcessor()([FRAMES])[:2])
    results, _ = generate(vl, [prompt], max_new_tokens=3, images=[images])
    assert printed == tok.decode(results[0].tokens).strip()
    for bad, match in ((["--image", str(tmp_path / "missing.png")], "--image .*missing.png: cannot read"),
                       (["--video", str(tmp_path / "ckpt" / "config.json")],
                        "neither an animation Pillow can read nor a video PyAV can decode")):
        with pytest.raises(SystemExit, match=match):
            main(argv[:4] + bad + ["--device", "cpu"])
    with pytest.raises(SystemExit, match="need --prompt text and a vision-language --checkpoint"):
        main(["--preset", "m3-tiny", "--prompt", "x", "--image", str(tmp_path / "cat.png"), "--device", "cpu"])
    model.save_pretrained(tmp_path / "text")
    tok.save(tmp_path / "text")
    with pytest.raises(SystemExit, match="is a text-only checkpoint"):
        main(["--checkpoint", str(tmp_path / "text"), *argv[2:]])


def test_video_frames_are_bounded(monkeypatch):
    from openm3.engine import media

    monkeypatch.setattr(media, "MAX_VIDEO_FRAME_PIXELS", 28 * 28 - 1)
    with pytest.raises(ValueError, match="v: the video's frames have 28x28 pixels; at most 783"):
        media.decode_video({"data": apng_base64(FRAMES[:2, :28, :28], 40), "where": "v"})
