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


def test_a_run_that_stops_early_leaves_no_earlier_report(tmp_path, monkeypatch):
    """The last run's metrics.json stayed until the new run wrote its own: a run that stopped on the way left it
    there as though it were its report. The report's files go when a run starts (after its settings are
    checked: tests/test_cli_errors.py)."""
    import openm3.data

    out = tmp_path / "report"
    out.mkdir()
    for name in REPORT_FILES:
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text("the last run's")

    def stopped(*_, **__):
        raise RuntimeError("stopped")

    monkeypatch.setattr(openm3.data, "get_tokenizer", stopped)  # the first step of the run after the clean-up
    with pytest.raises(RuntimeError, match="stopped"):
        main(["--out", str(out), "--steps", "1", "--no-progress"])
    assert sorted(p.name for p in out.iterdir()) == []


def test_samples_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """samples.md was written in place: a write that failed on the way (here: text its encoding cannot hold) left it
    cut short. It is replaced whole, as metrics.json is."""
    from types import SimpleNamespace

    import openm3.demo as demo

    class Tokenizer:
        def encode(self, text):
            return [1]

        def decode(self, ids, skip_special_tokens=False):
            return "\ud800"  # a lone surrogate: no encoding writes it

    qa = SimpleNamespace(prompt=[1], vision=None, sample=SimpleNamespace(question="q?", answer="a"))
    evaluator = SimpleNamespace(qa={"colour_qa": [qa], "video_qa": [qa]})
    monkeypatch.setattr(demo, "greedy", lambda *_, **__: [1])
    (tmp_path / "samples.md").write_text("the last run's\n")
    with pytest.raises(UnicodeEncodeError):
        demo.write_samples(None, Tokenizer(), evaluator, tmp_path)
    assert (tmp_path / "samples.md").read_text() == "the last run's\n"
    assert [p.name for p in tmp_path.iterdir()] == ["samples.md"]  # no temporary file left either


@pytest.mark.slow
def test_full_demo_reads_the_image(tmp_path):
    out = tmp_path / "report"
    assert main(["--out", str(out), "--no-progress"]) == 0
    m = check_report(out)
    assert m["image_qa_accuracy"] > m["image_qa_text_only_accuracy"]
    assert m["loss_last_10pct"] < m["loss_first"]
    assert m["seconds"]["total"] < 600
