"""`M3TextConfig`: the M3 text decoder's shape, with Hugging Face field names, and its presets.

Field names follow `transformers`' `MiniMaxM3VLTextConfig`, so a real `config.json` loads unchanged through
`M3TextConfig.from_dict` (including the published `sparse_attention_config` / `sparse_attention_freq` /
`moe_layer_freq` forms, the VL wrapper's nested `text_config`, and the RoPE forms `rope_theta`,
`rope_parameters` and `partial_rotary_factor`).

Partial RoPE: `rotary_dim` channels of each head are rotated. transformers 5.24.0 reads the rotated width only
from `rope_parameters["partial_rotary_factor"]` (it ignores `rotary_dim` and rotates the whole head when the factor
is absent); openm3 takes `partial_rotary_factor * head_dim` when the factor is given and `rotary_dim` otherwise,
and `to_dict` writes both, so a config openm3 saves means the same thing to both libraries.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

ATTENTION_TYPES = ("full_attention", "minimax_m3_sparse")
MLP_TYPES = ("dense", "sparse")

# Published names inside `sparse_attention_config` -> our (HF) field names.
_LEGACY_SPARSE_FIELDS = {
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
}


@dataclass
class M3TextConfig:
    """Shape of the M3 text decoder. Defaults are the real M3 (see the `m3` preset)."""

    vocab_size: int = 200064
    hidden_size: int = 6144
    intermediate_size: int = 3072  # per routed expert
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    rotary_dim: int = 64
    max_position_embeddings: int = 524288
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    layer_types: list[str] | None = None  # per layer: "full_attention" | "minimax_m3_sparse"
    mlp_layer_types: list[str] | None = None  # per layer: "dense" | "sparse" (MoE)
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 2.0
    shared_intermediate_size: int = 3072
    dense_intermediate_size: int = 12288
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 200034
    eos_token_id: int | list[int] | None = 200020
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # unknown config.json keys, kept for saving

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["sparse"] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        self.mlp_layer_types = list(self.mlp_layer_types)
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        for name in ("rms_norm_eps", "rope_theta", "swiglu_alpha", "swiglu_limit", "routed_scaling_factor"):
            _finite_number(name, getattr(self, name), positive=True)
        for name in ("initializer_range", "router_aux_loss_coef"):
            _finite_number(name, getattr(self, name), positive=False)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"M3TextConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        rotary = self.rotary_dim
        if not isinstance(rotary, int) or isinstance(rotary, bool) or not 0 <= rotary <= self.head_dim or rotary % 2:
            raise ValueError(f"M3TextConfig.rotary_dim must be an even int in [0, head_dim={self.head_dim}], "
                             f"got {self.rotary_dim!r}")
        _per_layer("layer_types", self.layer_types, ATTENTION_TYPES, self.num_hidden_layers)
        _per_layer("mlp_layer_types", self.mlp_layer_types, MLP_TYPES, self.num_hidden_layers)
        if "minimax_m3_sparse" in self.layer_types:
            for name in ("index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks",
                         "index_local_blocks"):
                _positive_int(name, getattr(self, name))
            if self.index_n_heads != self.num_key_value_heads:
                raise ValueError(f"M3TextConfig.index_n_heads ({self.index_n_heads}) must equal num_key_value_heads "
                                 f"({self.num_key_value_heads}): index head g selects blocks for KV head g")
            if self.index_local_blocks > self.index_topk_blocks:
                raise ValueError(f"M3TextConfig.index_local_blocks ({self.index_local_blocks}) must be <= "
                                 f"index_topk_blocks ({self.index_topk_blocks})")
        if "sparse" in self.mlp_layer_types:
            for name in ("intermediate_size", "num_local_experts", "num_experts_per_tok", "shared_intermediate_size"):
                _positive_int(name, getattr(self, name))
            if self.num_experts_per_tok > self.num_local_experts:
                raise ValueError(f"M3TextConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                                 f"num_local_experts ({self.num_local_experts})")
        if "dense" in self.mlp_layer_types:
            _positive_int("dense_intermediate_size", self.dense_intermediate_size)
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"M3TextConfig.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            ids = value if name == "eos_token_id" and isinstance(value, (list, tuple)) else [value]
            if value is not None and not all(_token_id(i, self.vocab_size) for i in ids):
                kind = ("None, a token id or a list of token ids (ints" if name == "eos_token_id"
                        else "None or a token id (an int")
                raise ValueError(f"M3TextConfig.{name} must be {kind} in [0, vocab_size={self.vocab_size})), "
                                 f"got {value!r}")

    # ------------------------------------------------------------------ derived
    @property
    def rope_parameters(self) -> dict[str, Any]:
        """The HF `rope_parameters` dict this config means (always the default RoPE type)."""
        return {"rope_type": "default", "rope_theta": float(self.rope_theta),
                "partial_rotary_factor": self.rotary_dim / self.head_dim}

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    def num_parameters(self) -> int:
        """Parameters (not buffers) implied by the shape; embeddings and lm_head counted separately unless tied."""
        h, d = self.hidden_size, self.head_dim
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for attn, mlp in zip(self.layer_types, self.mlp_layer_types):
            total += 2 * h + h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * d
            if attn == "minimax_m3_sparse":
                total += h * self.index_head_dim * (self.index_n_heads + 1) + 2 * self.index_head_dim
            if mlp == "dense":
                total += 3 * h * self.dense_intermediate_size
            else:
                total += self.num_local_experts * (3 * h * self.intermediate_size + h)
                total += 3 * h * self.shared_intermediate_size
        return total

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "M3TextConfig":
        """Build from a `config.json` dict: a text config, or a VL config whose `text_config` is used."""
        if not isinstance(data, dict):
            raise ValueError(f"config must be a dict, got {type(data).__name__}")
        data = dict(data)
        if "text_config" in data:
            outer = data
            data = dict(outer["text_config"] or {})
            if "tie_word_embeddings" not in data and "tie_word_embeddings" in outer:
                data["tie_word_embeddings"] = outer["tie_word_embeddings"]
        for key, allowed in _REQUIRED_VALUES.items():
            if key in data and data[key] not in allowed:
                raise ValueError(f"config.{key}={data[key]!r} is not supported (M3 uses {allowed[0]!r})")
        if "num_experts" in data and "num_local_experts" not in data:
            data["num_local_experts"] = data.pop("num_experts")

        sparse_cfg = data.pop("sparse_attention_config", None) or {}
        for legacy, name in _LEGACY_SPARSE_FIELDS.items():
            if legacy in sparse_cfg:
                data[name] = sparse_cfg[legacy]
        freq = sparse_cfg.get("sparse_attention_freq", data.pop("sparse_attention_freq", None))
        if data.get("layer_types") is None and freq is not None:
            data["layer_types"] = ["minimax_m3_sparse" if f else "full_attention" for f in _as_list(freq, data)]
        moe_freq = data.pop("moe_layer_freq", None)
        if data.get("mlp_layer_types") is None and moe_freq is not None:
            data["mlp_layer_types"] = ["sparse" if f else "dense" for f in _as_list(moe_freq, data)]

        _read_rope(data)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        vocab = known.get("vocab_size", cls.vocab_size)
        for key in ("bos_token_id", "eos_token_id"):
            # the defaults are M3's ids: a config of a smaller vocabulary that names none has none
            if key not in known and isinstance(vocab, int) and getattr(cls, key) >= vocab:
                known[key] = None
        extra = {k: v for k, v in data.items() if k not in names and k not in _DROPPED_KEYS}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """A flat HF text config (`model_type` minimax_m3_vl_text) that `from_dict` and transformers both read."""
        out = dict(self.extra)
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        out.pop("rope_theta")
        out["rope_parameters"] = self.rope_parameters
        out["model_type"] = "minimax_m3_vl_text"
        out["architectures"] = ["MiniMaxM3VLForCausalLM"]
        return out

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "M3TextConfig":
        """A preset (`m3`, `m3-small`, `m3-tiny`), optionally with fields overridden. A `num_hidden_layers` override
        without `layer_types` / `mlp_layer_types` gets them from the preset's pattern at the new depth (its first
        layers dense attention with a dense MLP, the rest MSA with MoE)."""
        if name not in PRESETS:
            raise ValueError(f"unknown config name {name!r}; expected one of {sorted(PRESETS)}")
        depth = {"layers": overrides["num_hidden_layers"]} if "num_hidden_layers" in overrides else {}
        if depth:
            _positive_int("num_hidden_layers", depth["layers"])
        return cls(**{**PRESETS[name](**depth), **overrides})


# Fields that some MiniMax configs carry; M3 (and this implementation) supports only these values.
_REQUIRED_VALUES = {"qk_norm_type": ("per_head",), "scoring_func": ("sigmoid",), "use_qk_norm": (True,)}

# Keys that describe the HF wrapper, the run or the file format (fp8 weights are dequantized on load) rather than the
# decoder; not kept in `extra`.
_DROPPED_KEYS = {"model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "auto_map",
                 "quantization_config", "rope_scaling", "partial_rotary_factor", "rope_parameters"}


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"M3TextConfig.{name} must be a positive int, got {value!r}")


def _finite_number(name: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not math.isfinite(value)) or value < 0 or (positive and value == 0):
        raise ValueError(f"M3TextConfig.{name} must be a finite number {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}")


def _token_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _per_layer(name: str, values: list[str], allowed: tuple[str, ...], num_layers: int) -> None:
    if len(values) != num_layers:
        raise ValueError(f"M3TextConfig.{name} must have num_hidden_layers={num_layers} entries, got {len(values)}")
    bad = sorted({v for v in values if v not in allowed})
    if bad:
        raise ValueError(f"M3TextConfig.{name} entries must be one of {allowed}, got {bad}")


def _as_list(freq: Any, data: dict[str, Any]) -> list[Any]:
    """A per-layer frequency list; an int `n` means every n-th layer (as in older MoE configs)."""
    if isinstance(freq, int) and not isinstance(freq, bool):
        layers = data.get("num_hidden_layers", 60)
        return [freq > 0 and i % freq == 0 for i in range(layers)]
    return list(freq)


def _read_rope(data: dict[str, Any]) -> None:
    """Fold the RoPE forms of a config.json into `rope_theta` and `rotary_dim` (in place)."""
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.rope_parameters must be a dict, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.rope_parameters.rope_type={rope_type!r} is not supported (only 'default')")
    if "rope_theta" in params:
        data["rope_theta"] = params["rope_theta"]
    factor = params.get("partial_rotary_factor", data.get("partial_rotary_factor"))
    if factor is not None:
        head_dim = data.get("head_dim", M3TextConfig.head_dim)
        rotary_dim = int(head_dim * factor)
        if "rotary_dim" in data and data["rotary_dim"] != rotary_dim:
            raise ValueError(f"config.rotary_dim={data['rotary_dim']} disagrees with partial_rotary_factor={factor} "
                             f"* head_dim={head_dim} = {rotary_dim}")
        data["rotary_dim"] = rotary_dim


def _dense_then_sparse(layers: int, dense: int) -> dict[str, Any]:
    """The presets' layer pattern: the first `dense` layers (at most all) dense attention with a dense MLP, the rest
    MSA with MoE."""
    first = min(dense, layers)
    return dict(num_hidden_layers=layers,
                layer_types=["full_attention"] * first + ["minimax_m3_sparse"] * (layers - first),
                mlp_layer_types=["dense"] * first + ["sparse"] * (layers - first))


def _m3(layers: int = 60) -> dict[str, Any]:
    # The real model: layers 0-2 dense attention with a dense MLP, layers 3-59 MSA with MoE (~428B total).
    return _dense_then_sparse(layers, 3)


def _m3_small(layers: int = 16) -> dict[str, Any]:
    # ~1.1B parameters (~0.3B active): fits one H200 with optimizer state for long-context and training runs.
    # MSA shapes are M3's: head dim 128, index 4x128, blocks of 128, top-16.
    return dict(vocab_size=32768, hidden_size=2048, intermediate_size=512,
                num_attention_heads=16, num_key_value_heads=4, head_dim=128, rotary_dim=64,
                max_position_embeddings=1 << 20, num_local_experts=16, num_experts_per_tok=2,
                shared_intermediate_size=1024, dense_intermediate_size=4096,
                bos_token_id=None, eos_token_id=None, **_dense_then_sparse(layers, 1))


def _m3_tiny(layers: int = 4) -> dict[str, Any]:
    # CPU tests and the demo: dense and MSA attention, dense MLP and MoE, small blocks.
    return dict(vocab_size=4096, hidden_size=128, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16, rope_theta=10000.0,
                max_position_embeddings=8192, index_n_heads=2, index_head_dim=32, index_block_size=16,
                index_topk_blocks=4, index_local_blocks=1, num_local_experts=8, num_experts_per_tok=2,
                shared_intermediate_size=128, dense_intermediate_size=256,
                bos_token_id=None, eos_token_id=None, **_dense_then_sparse(layers, 1))


PRESETS = {"m3": _m3, "m3-small": _m3_small, "m3-tiny": _m3_tiny}
