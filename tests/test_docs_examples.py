"""The Python examples of docs/usage.md run as written (with fewer steps)."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

USAGE = Path(__file__).resolve().parent.parent / "docs" / "usage.md"


def python_block(after: str) -> str:
    """The first ```python block after the heading `after`."""
    text = USAGE.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(after):], re.S).group(1)


def test_training_from_python(tmp_path, monkeypatch):
    from openm3.models import load_pretrained

    code = python_block("### Training from Python")
    assert "steps=20" in code
    monkeypatch.chdir(tmp_path)  # its run folder is relative
    scope = {}
    exec(compile(code.replace("steps=20", "steps=2"), str(USAGE), "exec"), scope)
    assert [r["step"] for r in scope["history"]] == [0, 1]
    assert (tmp_path / "runs" / "python" / "train_config.json").is_file()
    assert load_pretrained(tmp_path / "runs" / "python" / "model").config.vocab_size == scope["tokenizer"].vocab_size
