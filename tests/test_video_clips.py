"""The video clip length (temporal patches per clip, the span of the vision tower's attention) from the training
config through the data, the evaluator and the export to what generate / serve / eval read back."""

import json

import numpy as np
import pytest
import torch

from openm3.models.processor import (VIDEO_PROCESSOR_CONFIG, M3VideoProcessor, save_video_processor_config,
                                     video_frames_per_clip)
from openm3.models.vision import DEFAULT_FRAMES_PER_CLIP, check_frames_per_clip
from openm3.train.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("value", [0, -2, True, 2.0, "4"])
def test_a_bad_clip_length_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"video_frames_per_clip: expected a positive int .* got"):
        check_frames_per_clip(value, "video_frames_per_clip")
    with pytest.raises(ValueError, match="video_frames_per_clip: expected a positive int"):
        TrainConfig(video_frames_per_clip=value)
    with pytest.raises(ValueError, match="frames_per_clip: expected a positive int"):
        M3VideoProcessor(frames_per_clip=value)


@pytest.mark.parametrize("value", [1, 2, DEFAULT_FRAMES_PER_CLIP, None])
def test_the_processor_config_round_trips(tmp_path, value):
    path = save_video_processor_config(tmp_path, value)
    assert path.name == VIDEO_PROCESSOR_CONFIG == "video_preprocessor_config.json"  # transformers' file name
    settings = json.loads(path.read_text())
    assert settings["vision_segment_max_frames"] == value  # transformers' key (null: whole videos)
    assert settings["video_processor_type"] == "MiniMaxM3VLVideoProcessor" and settings["temporal_patch_size"] == 2
    assert video_frames_per_clip(tmp_path) == value


def test_reading_the_clip_length_defaults_as_transformers_and_names_a_bad_file(tmp_path):
    assert video_frames_per_clip(tmp_path) == DEFAULT_FRAMES_PER_CLIP == 4  # no file: transformers' default
    path = tmp_path / VIDEO_PROCESSOR_CONFIG
    path.write_text(json.dumps({"video_processor_type": "MiniMaxM3VLVideoProcessor", "patch_size": 14}))
    assert video_frames_per_clip(tmp_path) == 4  # no key: the default too
    for text, message in (("{not json", "not readable JSON"), ("[4]", "expected a JSON object, got list"),
                          ('{"vision_segment_max_frames": 0}', "vision_segment_max_frames: expected a positive")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message) as err:
            video_frames_per_clip(tmp_path)
        assert str(path) in str(err.value)


@pytest.fixture(scope="module")
def tokenizer():
    from openm3.data import get_tokenizer

    return get_tokenizer()


def _video_rows(tokenizer, frames_per_clip):
    from openm3.train.data import MixtureRows

    source = MixtureRows(tokenizer, 256, seed=3, weights={"video_qa": 1.0}, frames_per_clip=frames_per_clip)
    return source.rows("video", 0, 2)


def test_the_clip_length_splits_the_grid_rows_and_nothing_else(tokenizer):
    """Rows of the same step with clips of 1, 3 and all temporal patches: the same tokens, labels and pixels; the
    grid rows are the videos cut into clips of that many temporal patches (what the tower attends within)."""
    base = _video_rows(tokenizer, None)
    videos = base[0].vision["video_grid_thw"]
    assert videos.shape[0] >= 1 and all(int(t) >= 2 for t in videos[:, 0])  # 4-16 frames: 2-8 temporal patches
    for clip in (1, 3):
        rows = _video_rows(tokenizer, clip)
        for a, b in zip(base, rows):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
            assert torch.equal(a.vision["pixel_values_videos"], b.vision["pixel_values_videos"])
            whole, cut = a.vision["video_grid_thw"], b.vision["video_grid_thw"]
            want = [[min(clip, int(t) - s), int(h), int(w)] for t, h, w in whole for s in range(0, int(t), clip)]
            assert cut.tolist() == want


def test_training_checks_its_data_and_evaluator_against_the_config(tokenizer, tmp_path):
    from openm3.train.data import MixtureRows
    from openm3.train.eval import Evaluator
    from openm3.train.trainer import Trainer

    def never_built():
        raise AssertionError("the mismatch must be caught before the model is built")

    cfg = TrainConfig(video_frames_per_clip=2, out_dir=str(tmp_path), tensorboard=False, progress=False)
    source = MixtureRows(tokenizer, 64, weights={"video_qa": 1.0, "text:stdlib": 1.0})  # the default, 4
    with pytest.raises(ValueError, match="source cuts videos into clips of 4 temporal patches but "
                                         "cfg.video_frames_per_clip is 2"):
        Trainer(cfg, never_built, source)
    source = MixtureRows(tokenizer, 64, weights={"video_qa": 1.0, "text:stdlib": 1.0}, frames_per_clip=2)
    evaluator = Evaluator(tokenizer, seq_len=64, corpora=["stdlib"], windows=1, frames_per_clip=None)
    with pytest.raises(ValueError, match="evaluator cuts videos into clips of None"):
        Trainer(cfg, never_built, source, evaluator=evaluator)


def test_train_cli_takes_a_clip_length_or_all(capsys, tmp_path):
    from openm3.train.cli import build_config, parse_args

    assert build_config(parse_args(["--video-frames-per-clip", "2"])).video_frames_per_clip == 2
    save_video_processor_config(tmp_path, None)  # a run started from a checkpoint keeps its clips unless told
    assert build_config(parse_args(["--init-from", str(tmp_path)])).video_frames_per_clip is None
    given = parse_args(["--init-from", str(tmp_path), "--video-frames-per-clip", "1"])
    assert build_config(given).video_frames_per_clip == 1
    assert build_config(parse_args(["--video-frames-per-clip", "all"])).video_frames_per_clip is None
    assert build_config(parse_args([])).video_frames_per_clip == DEFAULT_FRAMES_PER_CLIP
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            parse_args(["--video-frames-per-clip", bad])
        assert "expected a positive number of temporal patches or 'all'" in capsys.readouterr().err


def test_the_evaluator_cuts_its_videos_as_configured_and_scores_each_kind(tokenizer, monkeypatch):
    from openm3.train import eval as ev_module
    from openm3.train.eval import Evaluator

    evs = {clip: Evaluator(tokenizer, seq_len=64, corpora=["stdlib"], windows=1, qa={"video_qa": 6},
                           baseline_samples=20, frames_per_clip=clip) for clip in (1, None)}
    for a, b in zip(evs[1].qa["video_qa"], evs[None].qa["video_qa"]):
        assert a.prompt == b.prompt
        assert a.vision["video_grid_thw"][:, 0].tolist() == [1] * int(b.vision["video_grid_thw"][0, 0])

    ev, items, picks = evs[None], evs[None].qa["video_qa"], [0, 1, 0, 1, 0, 1]
    chosen = iter(picks)
    monkeypatch.setattr(ev_module, "score_candidates", lambda model, qa, device: next(chosen))
    monkeypatch.setattr(ev, "_text", lambda model, device: {})
    result = ev.evaluate(torch.nn.Module())
    right = [pick == qa.sample.candidates.index(qa.sample.answer) for pick, qa in zip(picks, items)]
    assert result["video_qa/accuracy"] == sum(right) / 6
    kinds = {qa.sample.task.split(":")[1] for qa in items}
    assert len(kinds) >= 2 and {k for k in result if k.count("/") == 2} == {f"video_qa/{k}/accuracy" for k in kinds}
    for kind in kinds:
        oks = [ok for ok, qa in zip(right, items) if qa.sample.task == f"video_qa:{kind}"]
        assert result[f"video_qa/{kind}/accuracy"] == sum(oks) / len(oks)


def test_an_exported_vision_model_records_its_clip_length(tokenizer, tmp_path):
    from openm3.train.checkpoint import export_consolidated
    from openm3.train.distributed import DistInfo
    from openm3.train.factory import model_builder

    build = model_builder("m3-tiny", tokenizer)
    model = build()
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    out = export_consolidated(model, build, tmp_path / "vl", info, video_frames_per_clip=2)
    assert video_frames_per_clip(out) == 2
    text = model.language_model
    out = export_consolidated(text, lambda: type(text)(text.config), tmp_path / "text", info)
    assert not (out / VIDEO_PROCESSOR_CONFIG).exists()  # a text model has no video processor


def test_chat_prompts_cut_videos_into_the_given_clips(tokenizer, tmp_path):
    from PIL import Image

    from openm3.engine.media import chat_prompt
    from openm3.models import M3VLConfig

    frames = np.random.default_rng(0).integers(0, 256, (12, 56, 56, 3), dtype=np.uint8)
    first, *rest = [Image.fromarray(f) for f in frames]
    first.save(tmp_path / "clip.png", format="PNG", save_all=True, append_images=rest, duration=250)
    messages = [{"role": "user", "content": [{"type": "video", "path": str(tmp_path / "clip.png"), "where": "v"},
                                             {"type": "text", "text": "What moves?"}]}]
    vl = M3VLConfig.from_name("m3-tiny", image_token_index=tokenizer.image_id,
                              video_token_index=tokenizer.video_id, vocab_size=tokenizer.vocab_size)
    prompts = {clip: chat_prompt(tokenizer, messages, vl_config=vl, frames_per_clip=clip) for clip in (2, None)}
    assert prompts[2][0] == prompts[None][0]
    assert prompts[2][1].video_grid_thw[:, 0].tolist() == [2, 2, 2]
    assert prompts[None][1].video_grid_thw[:, 0].tolist() == [6]
    assert chat_prompt(tokenizer, messages, vl_config=vl)[1].video_grid_thw[:, 0].tolist() == [4, 2]  # default
