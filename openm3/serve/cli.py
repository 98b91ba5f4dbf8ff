"""`openm3 serve`: an OpenAI- and Anthropic-compatible HTTP server over one model (needs the `serve` extra:
fastapi, uvicorn).

    python -m openm3.serve.cli --preset m3-tiny --port 8000            # random weights, the locally trained tokenizer
    python -m openm3.serve.cli --checkpoint ckpt/ --tokenizer tok/ --device cuda --max-total-tokens 131072
    python -m openm3.serve.cli --preset m3-tiny --vision --port 8000   # random VL model: takes images too

    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \
        -d '{"model": "m3-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}'

Concurrent requests are decoded together (continuous batching, `openm3.engine.batching`: up to `--max-batch`
requests in a cache planned for `--token-budget` tokens; a request waits while the cache is full); `--max-batch 1`
serves one request at a time. With batching, pages of earlier requests stay cached until their memory is needed,
and a prompt that starts with an earlier prompt and its answer prefills only the rest (prefix caching;
`--no-prefix-caching` turns it off). A checkpoint with a `vision_config` is served as a vision-language model, which
takes images (base64 data in the requests, see `openm3.serve.images`). Errors in the arguments exit with
`error: ...`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


VLLM_REASONING_PARSERS = {"minimax_m2": "m3", "minimax_m2_append_think": "none"}  # vLLM's name -> ours


def build_parser() -> argparse.ArgumentParser:
    from ..cli import ArgumentParser
    from ..engine.generate import add_chat_template_argument, add_model_arguments, add_speculative_argument

    p = ArgumentParser(prog="openm3 serve", description="Serve a model behind the OpenAI HTTP API "
                                "(/v1/models, /v1/completions, /v1/chat/completions, /v1/responses) and "
                                "Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens).")
    add_model_arguments(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or a directory holding one (default: the "
                   "--checkpoint directory's tokenizer.json if it has one, else the locally trained tokenizer of "
                   "openm3.data, trained on first use)")
    add_chat_template_argument(p, "--default-chat-template-kwargs")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="where requests' default sampling comes from, as vLLM's option: auto (default) = the "
                   "--checkpoint's generation_config.json if it has one (temperature, top_p, top_k, min_p, "
                   "repetition_penalty, max_new_tokens: used for the fields a request leaves unset); vllm = none "
                   "(the API defaults); or a directory holding a generation_config.json")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="sampling defaults that replace or add to the generation config's, a JSON object such as "
                   "'{\"temperature\": 0.6}'")
    p.add_argument("--model-name", "--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model id clients send (default: preset or directory name); several names (vLLM's "
                   "--served-model-name) are all accepted, answers carry the first, e.g. an agent's fast-model name "
                   "beside the main one")
    p.add_argument("--api-key", default=os.environ.get("OPENM3_API_KEY"),
                   help="requests under /v1 must carry this key (Authorization: Bearer KEY, or x-api-key: KEY), as "
                   "vLLM's --api-key (default: $OPENM3_API_KEY; none: no check)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for every interface "
                   "(default: %(default)s)")
    p.add_argument("--port", type=port, default=8000, help="TCP port to listen on, 0-65535 (default: %(default)s)")
    p.add_argument("--max-total-tokens", "--max-model-len", type=int, default=None,
                   help="prompt + new tokens per request (default: min(32768, the model's max_position_embeddings); "
                   "--max-model-len is vLLM's name)")
    p.add_argument("--seed", type=int, default=0, help="init seed of a --preset model")
    p.add_argument("--vision", action="store_true", help="with --preset: a random vision-language model (the "
                   "preset's vision tower; placeholder ids from the tokenizer) that takes images. A --checkpoint is "
                   "served as one when its config.json has a vision_config")
    p.add_argument("--max-batch", "--max-num-seqs", type=int, default=8, help="requests decoded together "
                   "(continuous batching); 1 serves one request at a time (--max-num-seqs is vLLM's name; default: "
                   "%(default)s)")
    p.add_argument("--token-budget", type=int, default=None, help="tokens the shared cache is planned for, all "
                   "running requests' prompt + max_tokens together (default: --max-batch x --max-total-tokens)")
    p.add_argument("--chunk-size", "--max-num-batched-tokens", type=int, default=8192,
                   help="prefill tokens per forward (--max-num-batched-tokens is vLLM's name for its step's token "
                   "budget; here decode steps run apart from prefill chunks)")
    p.add_argument("--prefill-chunks-per-step", type=int, default=1, help="prefill forwards between two decode "
                   "steps while requests decode (prompts being prefilled take turns): a running request waits at "
                   "most this many chunks' forwards for its next token")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None, help="with --max-batch > 1: "
                   "launch each decode step before reading the last one's tokens back (default: on a GPU; the host's "
                   "work overlaps the GPU's; same tokens; steps with speculation or a constrained request run as "
                   "usual)")
    p.add_argument("--reasoning-parser", default="m3", choices=["m3", "none", *VLLM_REASONING_PARSERS],
                   help="m3 (default): the chat APIs return the model's <think> block apart from its answer "
                   "(reasoning_content, thinking blocks, reasoning items); none: it stays in the text (vLLM's "
                   "names for MiniMax's format: minimax_m2 is m3, minimax_m2_append_think is none)")
    p.add_argument("--tool-call-parser", default="m3", choices=["m3", "minimax_m2"],
                   help="the tool-call markup the chat APIs parse: M3's <minimax:tool_call> blocks, which vLLM's "
                   "minimax_m2 parser reads too (the only one: taken so a vLLM launch command carries over)")
    p.add_argument("--constrain-tool-calls", action="store_true",
                   help="under tool_choice auto, make every tool-call block the model opens follow the tools' "
                   "schemas (and a custom tool's input its grammar), as a forced call does; the text around stays "
                   "free (each such request's tokens are then picked on the host: slower steps)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice 'auto'; always on here (accepted, no effect)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="vLLM's switch; this server runs no code from a checkpoint (accepted, no effect)")
    p.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                   help="compute every prompt whole (default: a request whose prompt starts with an earlier "
                   "request's prompt and answer, as an agent's next turn does, reads those tokens' cached pages and "
                   "prefills only the rest; --no-enable-prefix-caching is vLLM's name)")
    p.add_argument("--index-dtype", default=None, choices=["bf16", "fp16", "fp32", "fp8"],
                   help="index-key cache dtype (default: the model dtype)")
    p.add_argument("--stored-responses", type=int, default=1024,
                   help="Responses API responses kept in memory for previous_response_id and GET /v1/responses/ID "
                   "(the last ones; 0: none are kept)")
    p.add_argument("--responses-dir", default=None, metavar="DIR",
                   help="keep the stored responses in DIR too (one JSON file each, written atomically) and read "
                   "them back at start, so previous_response_id works across restarts (default: memory only)")
    add_speculative_argument(p)
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="the order waiting requests are admitted in: fcfs (first come, first served) or priority "
                   "(a request's `priority` field, lower first, then arrival; vLLM's option; no preemption)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="decode steps run eagerly, not replayed as CUDA graphs (vLLM's flag)")
    vllm = p.add_argument_group("vLLM launch options taken so a vLLM command carries over")
    vllm.add_argument("--enable-prefix-caching", action="store_true", help="on by default here (no effect)")
    vllm.add_argument("--enable-chunked-prefill", action="store_true", help="prefill is always chunked (no effect)")
    vllm.add_argument("--disable-log-requests", "--no-enable-log-requests", action="store_true",
                      help="this server logs no requests (no effect)")
    vllm.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                      help="1 only: one server runs on one device")
    vllm.add_argument("--gpu-memory-utilization", type=float, default=None,
                      help="not taken: the cache is planned in tokens (--token-budget)")
    vllm.add_argument("--kv-cache-dtype", default="auto",
                      help="auto only: K/V pages are kept in the model's dtype (fp8 is for MSA index keys: "
                      "--index-dtype fp8)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line on stderr (throughputs, running / waiting requests, cache use)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between two stats lines (printed only while there is work; default 10)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (as `openm3 generate --compile`: decode steps ~1.9x "
                   "faster on an H200 at a 128K prompt, 1.7x on an H100 at 8 x 16K); compiles at start-up with a "
                   "few warm-up requests, before the server listens")
    return p


def port(text: str) -> int:
    """--port's type: a TCP port number, 0-65535 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {value}")
    return value


def build_app(args: argparse.Namespace):
    """The app for parsed arguments (model loaded, tokenizer checked); ValueError on a bad argument."""
    from ..data.chat_template import parse_template_variables
    from ..data.tokenizer import M3Tokenizer, get_tokenizer
    from ..engine.generate import (chat_template, compile_layers, device_and_dtype, load_model, preset_depth,
                                   speculative_option, tokenizer_path)
    from ..engine.batching import BatchedGenerator
    from ..engine.scheduler import text_model
    from ..engine.warmup import warm_up
    from ..models.processor import video_frames_per_clip
    from ..models.vision import DEFAULT_FRAMES_PER_CLIP
    from .app import ModelBackend, create_app

    check_vllm_options(args)
    device, dtype = device_and_dtype(args)  # a device this machine lacks fails before anything loads
    preset_depth(args)  # --layers: with --preset only, checked before anything loads
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        raise ValueError(f"--checkpoint: directory {args.checkpoint!r} does not exist")
    # the video clip length the checkpoint was trained with (a bad video_preprocessor_config.json fails here)
    clip = DEFAULT_FRAMES_PER_CLIP if args.checkpoint is None else video_frames_per_clip(args.checkpoint)
    speculative = speculative_option(args.speculative_config)  # before the model loads
    source = tokenizer_path(args.tokenizer, args.checkpoint)
    tokenizer = M3Tokenizer.from_file(source) if source else get_tokenizer()
    template = chat_template(args.chat_template, source)
    variables = parse_template_variables(args.default_chat_template_kwargs, "--default-chat-template-kwargs")
    sampling = default_sampling(args)
    if args.vision and args.preset is None:
        raise ValueError("--vision: only with --preset (a --checkpoint is a vision-language model when its "
                         "config.json has a vision_config)")
    if args.vision:
        model = _vision_preset(args, tokenizer, device, dtype)
    else:
        model = load_model(args, device, dtype, vision=True)  # a VL checkpoint loads as a VL model
    if args.compile:
        compile_layers(text_model(model))
    positions = text_model(model).config.max_position_embeddings
    limit = args.max_total_tokens
    if limit is None:
        limit = min(32768, positions)
    if not 2 <= limit <= positions:
        raise ValueError(f"--max-total-tokens: expected 2 .. {positions} (the model's max_position_embeddings), "
                         f"got {limit}")
    names = args.model_name or [args.preset or os.path.basename(os.path.normpath(args.checkpoint))]
    if args.max_batch < 1:
        raise ValueError(f"--max-batch: expected >= 1, got {args.max_batch}")
    if args.prefill_chunks_per_step < 1:
        raise ValueError(f"--prefill-chunks-per-step: expected >= 1, got {args.prefill_chunks_per_step}")
    if args.max_batch == 1 and args.scheduling_policy != "fcfs":
        raise ValueError("--scheduling-policy priority: needs the batching engine (--max-batch above 1); one request "
                         "at a time runs in arrival order")
    graphs = False if args.enforce_eager else None  # None: the engine's default (CUDA graphs on a GPU)
    if args.max_batch == 1:
        budget = None
        backend = ModelBackend(model, speculative, chunk_size=args.chunk_size, cuda_graphs=graphs)
    else:
        budget = args.token_budget if args.token_budget is not None else args.max_batch * limit
        if budget < limit:
            raise ValueError(f"--token-budget: {budget} tokens cannot hold one request of --max-total-tokens={limit}")
        backend = BatchedGenerator(model, token_budget=budget, max_batch=args.max_batch, chunk_size=args.chunk_size,
                                   index_dtype=args.index_dtype, prefix_caching=not args.no_prefix_caching,
                                   prefill_chunks_per_step=args.prefill_chunks_per_step, speculative=speculative,
                                   overlap=args.overlap, cuda_graphs=graphs,
                                   scheduling=args.scheduling_policy)
    if args.compile:  # compile now for the step shapes, not while the first requests wait
        seconds = warm_up(backend, text_model(model).config.vocab_size, args.max_batch, max_total_tokens=limit)
        print(f"--compile: the decoder layers compiled for serving in {seconds:.1f} s (warm-up requests)",
              file=sys.stderr)
    app = create_app(backend, tokenizer, model_name=names[0], model_aliases=names[1:], max_total_tokens=limit,
                     chat_template=template, default_template_variables=variables, default_sampling=sampling,
                     reasoning_parser=VLLM_REASONING_PARSERS.get(args.reasoning_parser, args.reasoning_parser),
                     constrain_tool_calls=args.constrain_tool_calls, api_key=args.api_key or None,
                     stored_responses=args.stored_responses, responses_dir=args.responses_dir,
                     video_frames_per_clip=clip)
    app.state.summary = summary(args, model, names, limit, tokenizer, source, device, dtype, budget)
    return app


def summary(args: argparse.Namespace, model, names: list[str], limit: int, tokenizer, source: str | None, device,
            dtype, budget: int | None) -> str:
    """What the server serves, the two lines `openm3 serve` prints before it listens: the model's names, where it
    came from, its size, dtype and device, the request limits and the tokenizer."""
    from ..data.tokenizer import default_cache_dir
    from ..engine.scheduler import is_vision_language

    n = sum(p.numel() for p in model.parameters())
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    origin = (f"checkpoint {args.checkpoint}" if args.checkpoint is not None else
              f"preset {args.preset}" + (f" at {args.layers} layers" if getattr(args, "layers", None) else "")
              + f" with random weights (seed {args.seed})")
    kind = "vision-language model, " if is_vision_language(model) else ""
    batch = "one request at a time" if budget is None else f"up to {args.max_batch} at once in a {budget}-token cache"
    where = source or f"openm3's trained tokenizer, cached under {default_cache_dir()}"
    return (f"openm3 serve: {' / '.join(repr(m) for m in names)} = {origin}: {kind}{size} parameters, "
            f"{str(dtype).removeprefix('torch.')} on {device}\n"
            f"  requests: at most {limit} tokens each, {batch}; tokenizer: {where} ({tokenizer.vocab_size} tokens)")


def check_vllm_options(args: argparse.Namespace) -> None:
    """ValueError naming a vLLM option whose value this server cannot honour (rather than ignoring it)."""
    if args.tensor_parallel_size != 1:
        raise ValueError(f"--tensor-parallel-size: openm3 serve runs on one device, got {args.tensor_parallel_size} "
                         f"(start one server per GPU)")
    if args.gpu_memory_utilization is not None:
        raise ValueError("--gpu-memory-utilization: the cache is planned in tokens here; pass --token-budget "
                         "(tokens all running requests hold together) instead")
    if args.kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype: only 'auto' (K/V pages in the model's dtype), got "
                         f"{args.kv_cache_dtype!r}; an fp8 cache here is for MSA index keys: --index-dtype fp8")
    if args.enable_prefix_caching and args.no_prefix_caching:
        raise ValueError("--enable-prefix-caching and --no-prefix-caching contradict each other")


def default_sampling(args: argparse.Namespace) -> dict:
    """The sampling defaults of --generation-config and --override-generation-config (ValueError naming the
    option that is bad); printed to stderr when there are any, as vLLM logs them."""
    from ..data.chat_template import parse_json_option
    from .generation_config import load_generation_config, sampling_defaults

    config = load_generation_config(args.generation_config, args.checkpoint)
    override = None
    if args.override_generation_config is not None:
        override = parse_json_option(args.override_generation_config, "--override-generation-config")
    defaults = sampling_defaults(config, override, where=f"--generation-config {args.generation_config}")
    if defaults:
        print(f"default sampling for fields a request leaves unset (--generation-config / "
              f"--override-generation-config): {defaults}", file=sys.stderr)
    return defaults


def _vision_preset(args: argparse.Namespace, tokenizer, device, dtype):
    """A random `M3ForConditionalGeneration` of the preset (seeded), its placeholder ids the tokenizer's."""
    import torch

    from ..engine.generate import for_inference, preset_depth
    from ..models import M3ForConditionalGeneration, M3VLConfig

    config = M3VLConfig.from_name(args.preset, image_token_index=tokenizer.image_id,
                                  video_token_index=tokenizer.video_id, **preset_depth(args))
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = M3ForConditionalGeneration(config)
    return for_inference(model.to(dtype))


def main(argv: Sequence[str] | None = None) -> int:
    """`openm3 serve ARGS` (see `build_parser`): builds the app and runs it with uvicorn until interrupted."""
    import uvicorn

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.log_stats_interval > 0:
        parser.error(f"--log-stats-interval: expected seconds > 0, got {args.log_stats_interval}")
    try:
        app = build_app(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    print(app.state.summary, file=sys.stderr, flush=True)
    if not args.disable_log_stats:
        app.state.stats_log.start(args.log_stats_interval)
    uvicorn.run(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
