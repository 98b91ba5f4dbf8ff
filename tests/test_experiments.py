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
    assert summary["text-only"]["bpb/topics"] == (3.5, 0.0) and "indexer_recall" not in native
    table = recipes.summary_table(summary)
    row = "| native | 5 | 3.000 ± 0.707 | 2.500 ± 0.707 | 3.500 ± 0.707 | 0.75 ± 0.35 | 0.50 ± 0.00 | - |"
    assert row in table
    assert "seeds [0, 1]" in table


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
    for changed in (["--windows", "2"], ["--set", "aux_loss_weight=0"], ["--blind"], ["--mismatched"],
                    ["--noise"]):
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
