"""A model's default sampling parameters from its `generation_config.json`, as vLLM takes them.

A released checkpoint ships the sampling its authors recommend in `generation_config.json` beside its weights
(temperature, top_p, ...). vLLM's server uses those as the defaults of every request that does not set them
(`--generation-config auto`, its default), and `--override-generation-config JSON` changes or adds some; `openm3
serve` does the same, with the same keys vLLM reads: `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty` and `max_new_tokens` (the default `max_tokens`, capped by the room the context limit leaves).
Other keys (`do_sample`, token ids, ...) are ignored there as vLLM ignores them, and a request's own values always
win. `top_k` -1 (vLLM's "off") means 0 here.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["GENERATION_CONFIG", "SAMPLING_KEYS", "load_generation_config", "sampling_defaults"]

GENERATION_CONFIG = "generation_config.json"
# key -> (lowest, highest, lowest excluded, kind): the ranges the request fields of the same names accept
SAMPLING_KEYS: dict[str, tuple[float, float | None, bool, type]] = {
    "temperature": (0.0, 2.0, False, float), "top_p": (0.0, 1.0, True, float), "top_k": (0, None, False, int),
    "min_p": (0.0, 1.0, False, float), "repetition_penalty": (0.0, None, True, float),
    "max_new_tokens": (1, None, False, int)}


def load_generation_config(option: str, model_dir: str | None) -> dict[str, Any]:
    """The generation config that `--generation-config` names: 'auto' reads `model_dir`'s generation_config.json
    ({} where there is none, or no model directory: a preset), 'vllm' reads none ({}), anything else is a
    directory holding one. ValueError naming the option for a missing file or one that is not a JSON object."""
    if option == "vllm":
        return {}
    if option == "auto":
        if model_dir is None or not os.path.isfile(os.path.join(model_dir, GENERATION_CONFIG)):
            return {}
        path = os.path.join(model_dir, GENERATION_CONFIG)
    else:
        path = os.path.join(option, GENERATION_CONFIG)
        if not os.path.isfile(path):
            raise ValueError(f"--generation-config: expected auto, vllm or a directory holding {GENERATION_CONFIG}, "
                             f"got {option!r} (no {path})")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--generation-config: cannot read {path} ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config: {path} must hold a JSON object, got {type(config).__name__}")
    return config


def sampling_defaults(config: dict[str, Any], override: dict[str, Any] | None = None,
                      *, where: str = "generation config") -> dict[str, float | int]:
    """The sampling defaults of a generation config (its `SAMPLING_KEYS`, other keys ignored) with `override` on
    top (vLLM's `--override-generation-config`: only those keys, null to drop one). ValueError naming `where`
    (or the override) for a value out of the request field's range."""
    if override is not None and not isinstance(override, dict):
        raise ValueError(f"--override-generation-config: expected a JSON object, got {type(override).__name__}")
    unknown = sorted(set(override or {}) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown keys {unknown}; expected some of "
                         f"{sorted(SAMPLING_KEYS)}")
    merged = {k: v for k, v in config.items() if k in SAMPLING_KEYS}
    merged.update(override or {})
    out: dict[str, float | int] = {}
    for key, value in merged.items():
        if value is None:
            continue
        source = "--override-generation-config" if key in (override or {}) else where
        low, high, open_low, kind = SAMPLING_KEYS[key]
        if key == "top_k" and value == -1:
            value = 0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ValueError(f"{source}: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        if value < low or (open_low and value == low) or (high is not None and value > high):
            bound = f"{'>' if open_low else '>='} {low}" + (f" and <= {high}" if high is not None else "")
            raise ValueError(f"{source}: {key} must be {bound}, got {value!r}")
        out[key] = kind(value)
    return out
