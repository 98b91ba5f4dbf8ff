"""Inference engine: paged KV + index-key caches planned from a token budget, chunked prefill, batched decode
(Triton MSA decode kernels on CUDA, replayed as CUDA graphs), continuous batching, sampling, and `generate` (CLI
entry: `openm3.engine.generate.main`); prompts with images for vision-language models (`PromptImages`)."""

from .batching import BatchedGenerator
from .cache import CacheFullError, CacheLayout, CachePlan, PagedCache, plan_cache
from .generate import GenerationResult, GenerationStats, for_inference, generate
from .graphs import DecodeGraphs
from .sampling import SamplingParams, sample
from .scheduler import PromptImages, decode_step, prefill

__all__ = ["BatchedGenerator", "CacheFullError", "CacheLayout", "CachePlan", "PagedCache", "plan_cache",
           "GenerationResult", "GenerationStats", "generate", "for_inference", "DecodeGraphs", "SamplingParams",
           "sample", "decode_step", "prefill", "PromptImages"]
