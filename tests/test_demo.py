"""`openm3 demo`: the report folder it writes (short run) and, marked slow, the full run's claim."""

import json

import pytest

from openm3.demo import main, parse_args


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

REPORT_FILES = ("metrics.json", "metrics.jsonl", "loss_curve.png", "attention_map.png", "indexer_blocks.png",
                "samples.md", "model/config.json")


def check_report(out):
    for name in REPORT_FILES:
        assert (out / name).is_file(), name
    for png in ("loss_curve.png", "attention_map.png", "indexer_blocks.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / "metrics.json").read_text())


def test_short_demo_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["--out", str(out), "--steps", "3", "--image-qa", "3", "--video-qa", "2", "--no-progress"]) == 0
    m = check_report(out)
    assert m["steps"] == 3 and m["model"] == "m3-tiny" and m["recipe"] == "native"
    for key in ("image_qa_accuracy", "image_qa_text_only_accuracy", "video_qa_accuracy", "indexer_recall"):
        assert 0.0 <= m[key] <= 1.0 + 1e-6, key
    assert any(s["kind"] == "colour_qa" for s in m["samples"])
    assert {f"bpb/{c}" for c in ("stdlib", "topics", "bible_web", "bible_kjv")} <= set(m["eval"])
    assert str(out.resolve()) in capsys.readouterr().out


def test_bad_arguments_fail():
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])


@pytest.mark.slow
def test_full_demo_reads_the_image(tmp_path):
    out = tmp_path / "report"
    assert main(["--out", str(out), "--no-progress"]) == 0
    m = check_report(out)
    assert m["image_qa_accuracy"] > m["image_qa_text_only_accuracy"]
    assert m["loss_last_10pct"] < m["loss_first"]
    assert m["seconds"]["total"] < 600
