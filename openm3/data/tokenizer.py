"""Byte-level BPE tokenizer trained locally on the offline corpora, with the M3 chat format's special tokens.

The special strings are the ones M3 uses (``transformers`` ``MiniMaxM3VLProcessor`` and the MiniMax chat format):
``]~!b[`` begins a conversation, ``]~b]`` begins a turn (the role name follows as text: ``]~b]user``), ``[e~[`` ends a
turn (and is the end-of-sequence token), ``]<]image[>[`` / ``]<]video[>[`` are visual placeholders wrapped in
``]<]start of image[>[`` ... ``]<]end of image[>[``, ``<minimax:tool_call>`` ... ``</minimax:tool_call>`` wrap tool
calls and ``<think>`` ... ``</think>`` reasoning. They take ids ``0 .. len(SPECIAL_TOKENS) - 1`` in that order.

Training is cached: ``get_tokenizer()`` returns the tokenizer stored under
``<cache_dir>/tokenizer-<hash of the settings>/tokenizer.json`` and trains it only when that file is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..files import atomic_write, remove_orphaned_temporaries
from .corpora import CORPORA, load_corpus, require

PAD = "]!p~["
BOS = "]~!b["
EOS = "[e~["
ROLE = "]~b]"
IMAGE = "]<]image[>["
VIDEO = "]<]video[>["
VISION_START = "]<]start of image[>["
VISION_END = "]<]end of image[>["
TOOL_CALL_START = "<minimax:tool_call>"
TOOL_CALL_END = "</minimax:tool_call>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (
    PAD, BOS, EOS, ROLE, IMAGE, VIDEO, VISION_START, VISION_END,
    TOOL_CALL_START, TOOL_CALL_END, THINK_START, THINK_END,
)  # fmt: skip
# Part of the cache key: bump when the training text changes for the same settings (corpus cleaning, order).
_FORMAT_VERSION = 2


@dataclass(frozen=True)
class TokenizerSettings:
    """What a trained tokenizer depends on; its hash names the cache entry.

    ``chars_per_corpus`` bounds the training text taken from each corpus's train split (whole documents in a
    fixed hashed order until the budget is reached), which keeps training under ~30 s on 2 cores.
    """

    vocab_size: int = 4096
    min_frequency: int = 2
    chars_per_corpus: int = 1_500_000
    corpora: tuple[str, ...] = CORPORA
    heldout_fraction: float = 0.05
    # Corpora depend on this interpreter's stdlib and on the data packages: part of the key.
    python_version: str = field(default_factory=platform.python_version)

    def __post_init__(self):
        if self.vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
            raise ValueError(f"vocab_size: expected at least {256 + len(SPECIAL_TOKENS) + 1}, got {self.vocab_size}")
        if self.min_frequency < 1:
            raise ValueError(f"min_frequency: expected >= 1, got {self.min_frequency}")
        if self.chars_per_corpus < 1:
            raise ValueError(f"chars_per_corpus: expected >= 1, got {self.chars_per_corpus}")
        unknown = [c for c in self.corpora if c not in CORPORA]
        if unknown or not self.corpora:
            raise ValueError(f"corpora: expected a non-empty subset of {CORPORA}, got {self.corpora}")

    def key(self) -> str:
        tokenizers = require("tokenizers", "tokenizers")
        blob = json.dumps({**asdict(self), "tokenizers": tokenizers.__version__, "v": _FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def training_texts(settings: TokenizerSettings) -> Iterator[str]:
    """Train-split documents of each corpus in a fixed hashed order, at most ``chars_per_corpus`` chars per corpus."""
    for corpus in settings.corpora:
        docs = load_corpus(corpus, "train", settings.heldout_fraction)
        docs.sort(key=lambda d: hashlib.sha256(d.doc_id.encode()).digest())
        budget = settings.chars_per_corpus
        for doc in docs:
            if budget <= 0:
                break
            text = doc.text[:budget]
            budget -= len(text)
            yield text


class M3Tokenizer:
    """A ``tokenizers.Tokenizer`` with the M3 special tokens and their ids.

    ``encode(text) -> list[int]`` never adds tokens on its own (the chat template writes ``]~!b[``);
    ``decode(ids)`` keeps special tokens, so ``decode(encode(s)) == s`` for any string ``s``.
    """

    def __init__(self, backend):
        self.backend = backend
        ids = {tok: backend.token_to_id(tok) for tok in SPECIAL_TOKENS}
        missing = [tok for tok, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"backend: tokenizer lacks the M3 special tokens {missing}")
        self.special_ids = ids
        self.pad_id, self.bos_id, self.eos_id, self.role_id = ids[PAD], ids[BOS], ids[EOS], ids[ROLE]
        self.image_id, self.video_id = ids[IMAGE], ids[VIDEO]
        self.vision_start_id, self.vision_end_id = ids[VISION_START], ids[VISION_END]

    @classmethod
    def from_file(cls, path: str | Path) -> M3Tokenizer:
        """Load a ``tokenizer.json`` (a file, or a directory holding one)."""
        Tokenizer = require("tokenizers", "tokenizers").Tokenizer
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"path: expected a tokenizer.json file or a directory holding one, got {str(path)!r}")
        return cls(Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``; nothing is added (no ``]~!b[``: the chat template writes it), and special
        token strings in the text (``[e~[``, ``]<]image[>[``, ...) become their ids. ValueError for a non-str;
        `NotUnicode` (a ValueError) for a str holding a lone surrogate (JSON's "\\ud800" parses to one)."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected str, got {type(text).__name__}")
        try:
            return self.backend.encode(text, add_special_tokens=False).ids
        except TypeError:
            _check_unicode(text)
            raise

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        try:
            return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        except TypeError:
            for text in texts:
                _check_unicode(text)
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids ``ids`` (ints, or a 1-D tensor); special tokens are kept unless
        ``skip_special_tokens``, so ``decode(encode(s)) == s``."""
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        i = self.backend.token_to_id(token)
        if i is None:
            raise ValueError(f"token: {token!r} is not a single token of this vocabulary")
        return i

    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` into ``directory``.

        ``transformers.AutoTokenizer.from_pretrained(directory)`` then loads it, and its ``apply_chat_template``
        renders what :func:`openm3.data.chat.render_chat` renders. Returns the path of ``tokenizer.json``.
        """
        from .chat import CHAT_TEMPLATE

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "tokenizer.json"
        self.backend.save(str(path))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "model_max_length": 1 << 20,
            "extra_special_tokens": {"image_token": IMAGE, "video_token": VIDEO},
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        return path


class IncrementalText:
    """`tokenizer.decode(tokens)` kept up to date one token at a time, decoding only the last few tokens.

    Decoding the whole answer again at every token costs O(n) per token (~0.9 ms at 4K tokens and ~2.8 ms at 16K
    on a 2-core CPU, the serving loop's host time): O(n^2) per answer. Here each push decodes a short window that
    starts at `prefix` (the last settled point but one): the text the window adds past the part already settled
    (`tokens[prefix:read]`) is appended once it no longer ends in an unfinished character (U+FFFD), and `read`
    moves to the end. Both decodes of a window start at the same token, so decoders that treat a sequence's first
    token specially (a stripped leading space) treat both alike. `text` equals the whole decode (a test checks it
    token by token on the project's tokenizer, multi-byte characters split across tokens included).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.settled = ""  # the text of tokens[:read]
        self._prefix = self._read = 0
        self._prefix_text = ""  # the text of tokens[prefix:read] decoded on its own
        self.text = ""

    def push(self, token: int) -> str:
        """Append `token`; returns the whole text so far (unfinished characters as U+FFFD, as the full decode)."""
        self.tokens.append(token)
        window = self.tokenizer.decode(self.tokens[self._prefix:])
        if not window.startswith(self._prefix_text):  # a decoder whose windows disagree here: start over whole
            self.settled, self._prefix, self._read, self._prefix_text = "", 0, 0, ""
            window = self.tokenizer.decode(self.tokens)
        added = window[len(self._prefix_text):]
        if added and not added.endswith("\ufffd"):
            self.settled += added
            self._prefix, self._read = self._read, len(self.tokens)
            self._prefix_text = self.tokenizer.decode(self.tokens[self._prefix:self._read])
            added = ""
        self.text = self.settled + added
        return self.text


def train_tokenizer(settings: TokenizerSettings | None = None, texts: Iterator[str] | None = None) -> M3Tokenizer:
    """Train a byte-level BPE on ``texts`` (default: :func:`training_texts` of ``settings``)."""
    tk = require("tokenizers", "tokenizers")
    settings = settings or TokenizerSettings()
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=settings.vocab_size,
        min_frequency=settings.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts if texts is not None else training_texts(settings), trainer=trainer)
    return M3Tokenizer(backend)


class NotUnicode(ValueError):
    """A str that is not valid Unicode text (a lone surrogate): nothing can encode it."""


def _check_unicode(text: str) -> None:
    """`NotUnicode` naming the first lone surrogate of `text`, if it holds one (not where: the text may be a
    rendered prompt, not the caller's)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise NotUnicode(f"the text holds a lone surrogate {text[e.start]!r}, which is not valid Unicode (a pair "
                         f"such as '\\ud83d\\ude00' is)") from None


def default_cache_dir() -> Path:
    """``$OPENM3_CACHE`` if set, else ``~/.cache/openm3``."""
    return Path(os.environ.get("OPENM3_CACHE") or Path.home() / ".cache" / "openm3")


def get_tokenizer(settings: TokenizerSettings | None = None, cache_dir: str | Path | None = None) -> M3Tokenizer:
    """The tokenizer for ``settings``, loaded from the cache or trained and cached (written atomically)."""
    settings = settings or TokenizerSettings()
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = directory / f"tokenizer-{settings.key()}"
    path = entry / "tokenizer.json"
    if entry.is_dir():  # what crashed writers left, swept whenever the entry is used (not only when rebuilt)
        remove_orphaned_temporaries(entry, re.escape("tokenizer.json"))
    if path.is_file():
        try:
            return M3Tokenizer.from_file(path)
        except Exception as err:  # a file a power loss or a full disk cut short: trained again, as on first use
            warnings.warn(f"the cached tokenizer {path} is unreadable ({err}); training it again")
    tok = train_tokenizer(settings)
    entry.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        tok.backend.save(tmp)
        with open(tmp, "rb+") as f:  # on disk before the rename makes it the cache's
            os.fsync(f.fileno())
        (entry / "settings.json").write_text(json.dumps(asdict(settings), indent=1, sort_keys=True))
    return tok


def main(argv: list[str] | None = None) -> int:
    """``python -m openm3.data.cli tokenizer [--out DIR]``: train (or load from the cache) and optionally export."""
    from ..cli import ArgumentParser

    parser = ArgumentParser(prog="openm3 data tokenizer", description="Train or load the cached tokenizer.")
    parser.add_argument("--vocab-size", type=int, default=TokenizerSettings.vocab_size)
    parser.add_argument("--chars-per-corpus", type=int, default=TokenizerSettings.chars_per_corpus)
    parser.add_argument("--cache-dir", default=None, help="default: $OPENM3_CACHE or ~/.cache/openm3")
    parser.add_argument("--out", default=None, help="also write tokenizer.json, its config and chat template here")
    args = parser.parse_args(argv)
    settings = TokenizerSettings(vocab_size=args.vocab_size, chars_per_corpus=args.chars_per_corpus)
    tok = get_tokenizer(settings, args.cache_dir)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    print(f"tokenizer {settings.key()}: {tok.vocab_size} tokens, cached in {cache / f'tokenizer-{settings.key()}'}")
    if args.out:
        print(f"wrote {tok.save(args.out)}")
    return 0
