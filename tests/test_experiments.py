"""experiments/recipes.py: the four recipes train on one text budget, each run is kept as it finishes (a rerun
trains nothing new), and the summary's means and spreads are those of the runs."""

import json
import math

import pytest

from experiments import recipes

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _record(recipe, seed, bpb, image):
    return {"recipe": recipe, "seed": seed, "vision_steps": 0 if recipe == "text-only" else 5, "text_tokens": 100,
            "bpb": {"stdlib": bpb, "topics": bpb + 1}, "bpb_mean": bpb + 0.5, "colour_qa_accuracy": image,
            "video_qa_accuracy": 0.5, "indexer_recall": None, "colour_qa_text_only_baseline": 0.2,
            "video_qa_text_only_baseline": 0.4}


def test_summary_means_and_spreads():
    runs = [_record("native", 0, 2.0, 1.0), _record("native", 1, 3.0, 0.5), _record("text-only", 0, 2.5, 0.1)]
    summary = recipes.summarise(runs)
    assert list(summary) == ["text-only", "native"]  # the recipes' order, whatever the runs' order
    native = summary["native"]
    assert native["seeds"] == [0, 1] and native["bpb/stdlib"] == (2.5, pytest.approx(math.sqrt(0.5)))
    assert native["bpb_mean"] == (3.0, pytest.approx(math.sqrt(0.5)))
    assert native["colour_qa_accuracy"] == (0.75, pytest.approx(math.sqrt(0.125)))
    assert summary["text-only"]["bpb/topics"] == (3.5, None) and "indexer_recall" not in native  # one seed
    table = recipes.summary_table(summary)
    row = "| native | 5 | 3.000 ± 0.707 | 2.500 ± 0.707 | 3.500 ± 0.707 | 0.75 ± 0.35 | 0.50 ± 0.00 | - |"
    assert row in table and "| text-only | 0 | 3.000 | 2.500 | 3.500 | 0.10 | 0.50 | - |" in table
    assert "Mean ± sample standard deviation over seeds [0, 1]." in table
    alone = recipes.summary_table(recipes.summarise(runs[:1]))
    assert "| native | 5 | 2.500 | 2.000 | 3.000 | 1.00 | 0.50 | - |" in alone and "±" not in alone
    assert "One seed (0): no spread" in alone


def test_bad_settings_fail_before_training(capsys):
    for argv in (["--mid-start", "0.8"], ["--cpt-fraction", "1"], ["--steps", "0"], ["--recipes", "late"]):
        with pytest.raises(SystemExit) as err:
            recipes.parse_args(argv)
        assert err.value.code == 2
    assert "--mid-start must be in (0, 0.75)" in capsys.readouterr().err


def test_recipes_share_the_text_budget_and_a_rerun_trains_nothing(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--recipes", "native", "cpt", "--seeds", "0", "--steps", "8", "--jobs", "1",
            "--windows", "1", "--image-qa", "2", "--video-qa", "2"]
    assert recipes.main(argv) == 0
    first = json.loads((tmp_path / "summary.json").read_text())
    runs = {r["recipe"]: r for r in first["runs"]}
    assert set(runs) == {"native", "cpt"} and (tmp_path / "text_loss.png").stat().st_size > 0
    assert runs["native"]["vision_steps"] == 8 and runs["cpt"]["vision_steps"] == 2  # the last quarter
    assert runs["native"]["text_tokens"] == runs["cpt"]["text_tokens"] == 8 * 256
    assert runs["native"]["tokens"] > runs["cpt"]["tokens"]  # vision rows on top of the same text rows
    for r in runs.values():
        assert set(r["bpb"]) == {"stdlib", "topics", "bible_web", "bible_kjv"} and math.isfinite(r["bpb_mean"])
    assert "| cpt | 2 |" in (tmp_path / "summary.md").read_text()
    capsys.readouterr()
    assert recipes.main(argv) == 0
    assert "0 runs to train (2 already in" in capsys.readouterr().out
    assert json.loads((tmp_path / "summary.json").read_text())["runs"] == first["runs"]
    stored = tmp_path / "runs" / "cpt_s0.json"  # a run made before TrainConfig had video_frames_per_clip
    record = json.loads(stored.read_text())
    del record["config"]["video_frames_per_clip"]
    stored.write_text(json.dumps(record))
    capsys.readouterr()
    assert recipes.main(argv) == 0 and "0 runs to train (2 already in" in capsys.readouterr().out
    for changed in (["--windows", "2"], ["--set", "aux_loss_weight=0"], ["--blind"], ["--mismatched"],
                    ["--noise"], ["--set", "video_frames_per_clip=2"]):
        with pytest.raises(SystemExit, match="made with other settings"):
            recipes.main(argv + changed)


def test_set_overrides_config_fields_and_refuses_recipe_settings(capsys):
    args = recipes.parse_args(["--set", "aux_loss_weight=0", "kl_weight=0.5", "decay_shape=cosine"])
    assert args.overrides == {"aux_loss_weight": 0, "kl_weight": 0.5, "decay_shape": "cosine"}
    cfg = recipes.run_config(args, "mid", 3, "unused")
    assert (cfg.aux_loss_weight, cfg.kl_weight, cfg.decay_shape, cfg.vision_start_step, cfg.seed) == \
        (0, 0.5, "cosine", 120, 3)
    for bad in ("steps=5", "no_such_field=1", "kl_weight"):
        with pytest.raises(SystemExit):
            recipes.parse_args(["--set", bad])
    assert "--set 'kl_weight'" in capsys.readouterr().err


def test_clips_probe_trains_each_length_and_a_rerun_trains_nothing(tmp_path, capsys):
    """experiments/clips.py's tower probe: runs differ only in the clip length, each records video QA per kind
    next to the question-only baseline and the tower's time; M3-scale costs grow as attention_plan says."""
    from experiments import clips

    argv = ["--out", str(tmp_path), "--clips", "1", "all", "--seeds", "0", "--steps", "3", "--jobs", "1",
            "--video-qa", "12", "--timing-videos", "2"]
    assert clips.main(argv) == 0
    first = json.loads((tmp_path / "summary.json").read_text())
    runs = {r["clip"]: r for r in first["runs"]}
    assert set(runs) == {"1", "all"} and runs["1"]["settings"]["clip"] == 1 and runs["all"]["settings"]["clip"] is None
    for r in runs.values():
        assert r["part"] == "probe" and 0 <= r["video_qa_accuracy"] <= 1 and r["tower_ms"] > 0
        kinds = [k for k in clips.VIDEO_KINDS if r[f"video_qa/{k}"] is not None]
        assert kinds and all(0 <= r[f"baseline/{k}"] <= 1 for k in clips.VIDEO_KINDS)
    assert runs["1"]["train_loss_last_100"] != runs["all"]["train_loss_last_100"]  # the clips change the tower
    costs = {(c["video"], c["clip"]): c for c in first["m3_costs"]}
    short, whole = costs[("64 frames 448x448", "1")], costs[("64 frames 448x448", "all")]
    assert short["linear_gflop"] == whole["linear_gflop"] and short["clip_patches"] == 32 * 32
    assert whole["attention_gflop"] == pytest.approx(32 * short["attention_gflop"])  # 32x the patches per clip
    assert "| all | all |" in (tmp_path / "summary.md").read_text()
    capsys.readouterr()
    assert clips.main(argv) == 0
    assert "0 runs to train (2 already in" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="made with other settings"):
        clips.main(argv + ["--video-qa", "4"])
    for bad in (["--clips", "0"], ["--clips", "2", "2"], ["--steps", "0"], ["--part", "tower"]):
        with pytest.raises(SystemExit):
            clips.parse_args(bad)
    ordered = ["--out", str(tmp_path / "ordered"), "--clips", "2", "--seeds", "0", "--steps", "2", "--jobs", "1",
               "--video-qa", "8", "--timing-videos", "2", "--readout", "ordered"]
    assert clips.main(ordered) == 0
    (run,) = json.loads((tmp_path / "ordered" / "summary.json").read_text())["runs"]
    assert run["settings"]["readout"] == "ordered" and "readout" not in runs["1"]["settings"]


def test_clips_model_part_trains_the_vl_model_with_its_clips(tmp_path):
    from experiments import clips

    argv = ["--out", str(tmp_path), "--part", "model", "--clips", "2", "--seeds", "0", "--steps", "2", "--jobs", "1",
            "--windows", "1", "--image-qa", "0", "--video-qa", "4", "--timing-videos", "2"]
    assert clips.main(argv) == 0
    (run,) = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert run["part"] == "model" and run["settings"]["config"]["video_frames_per_clip"] == 2
    assert 0 <= run["video_qa_accuracy"] <= 1 and run["colour_qa_accuracy"] is None and run["bpb_mean"] > 0
    assert "| 2 | 4 |" in (tmp_path / "summary.md").read_text()
