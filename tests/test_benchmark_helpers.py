"""The profiling and result-file helpers the GPU benchmarks share (`benchmarks/_timing.py`), on CPU."""

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks._timing import profiled_times, top_host_ops, write_result


def test_profiled_times_and_top_host_ops():
    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            a = a @ a
        a.relu()
    kernels, host = profiled_times(prof)
    assert kernels == {}  # no CUDA activity on CPU
    assert host["aten::mm"][1] == 3 and host["aten::relu"][1] == 1
    rows = top_host_ops(host, top=2)
    assert len(rows) == 2 and rows[0]["ms"] >= rows[1]["ms"]
    assert set(rows[0]) == {"op", "ms", "calls"}


def test_write_result(tmp_path):
    path = write_result(tmp_path / "out", "bench", {"x": 1.5})
    assert path.endswith(".json") and "bench_" in path
    got = json.loads(open(path).read())
    assert got["x"] == 1.5 and set(got) == {"x", "env"}
    assert {"date", "torch", "triton"} <= set(got["env"]) and got["env"]["date"].startswith("20")
    kept = write_result(tmp_path / "out", "bench", {"x": 2, "env": {"gpu": "mine"}})
    assert json.loads(open(kept).read())["env"] == {"gpu": "mine"}  # a result's own record stays
    # the same minute (or not): every write keeps its own file, none overwrites an earlier one
    third = write_result(tmp_path / "out", "bench", {"x": 3})
    assert len({path, kept, third}) == 3 and len(list((tmp_path / "out").glob("bench_*.json"))) == 3
    assert [json.loads(open(p).read())["x"] for p in (path, kept, third)] == [1.5, 2, 3]


def test_serve_prefix_benchmark_runs_on_cpu(tmp_path, capsys):
    from benchmarks import serve_prefix

    assert serve_prefix.main(["--preset", "m3-tiny", "--device", "cpu", "--context", "80", "--turn-tokens", "20",
                              "--new", "3", "--turns", "2", "--parallel", "2", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("serve_prefix_*.json")
    res = json.loads(path.read_text())
    assert sorted(res["parallel"]["cached"]["cached_tokens"]) == [0, 80] and res["parallel"]["uncached"][
        "cached_tokens"] == [0, 0]
    runs = res["runs"]
    assert [t["cached_tokens"] for t in runs["uncached"]] == [0, 0]
    assert [t["cached_tokens"] for t in runs["cached"]] == [0, 80]  # 16-token pages: turn 1's 82 fed -> 5 pages


def test_serve_batching_benchmark_runs_on_cpu(tmp_path, capsys):
    from benchmarks import serve_batching

    assert serve_batching.main(["--preset", "m3-tiny", "--device", "cpu", "--prompt-len", "32", "--new", "3",
                                "--batch", "1", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "max batch   1: 1 requests, 3 new tokens" in out and "max batch   2: 2 requests, 6 new tokens" in out
    (path,) = tmp_path.glob("serve_batching_*.json")
    rounds = json.loads(path.read_text())["rounds"]
    assert set(rounds) == {"1", "2"} and all(r["tokens_per_s"] > 0 for r in rounds.values())
    # staggered: 3 requests per batch slot, each with its own prompt length and new tokens
    assert serve_batching.main(["--preset", "m3-tiny", "--device", "cpu", "--prompt-len", "32", "--prompt-len-min",
                                "8", "--new", "4", "--new-min", "1", "--requests-per-batch", "3", "--batch", "2",
                                "--rounds", "2", "--out", str(tmp_path / "staggered")]) == 0
    (path,) = (tmp_path / "staggered").glob("serve_batching_*.json")
    row = json.loads(path.read_text())["rounds"]["2"]
    assert row["requests"] == 6 and 6 <= row["new_tokens"] <= 24 and row["graphs"]["captures"] is None  # CPU
    # two rounds through one generator, each timed; the second's other prompts miss the prefix cache
    assert len(row["walls_s"]) == 2 and row["wall_s"] == row["walls_s"][0] and all(w > 0 for w in row["walls_s"])
    assert row["prefix_cached_tokens"] == 0
    assert row["batch_sizes"] and sum(row["batch_sizes"].values()) == row["decode_steps"]
    with pytest.raises(SystemExit):
        serve_batching.main(["--device", "cpu", "--rounds", "0"])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err


def test_generate_repeat_runs_its_steps_on_cpu(tmp_path, capsys):
    """The fourth-capture probe (`benchmarks/generate_repeat.py`) runs its CPU-meaningful steps in order and
    records one row per run; an unknown step fails before the model is built, naming the known ones."""
    from benchmarks import generate_repeat

    assert generate_repeat.main(["--preset", "m3-tiny", "--device", "cpu", "--prompt", "24", "--batch", "2",
                                 "--new", "3", "--steps", "plain,keep,b1,clean,fp8idx", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("generate_repeat_b2_*.json")
    runs = json.loads(path.read_text())["runs"]
    assert [r["phase"] for r in runs] == ["plain", "b1", "fp8idx"] and all(r["tokens_per_s"] > 0 for r in runs)
    with pytest.raises(SystemExit):
        generate_repeat.main(["--device", "cpu", "--steps", "plain,kprof,bogus,b0"])
    err = capsys.readouterr().err
    assert "unknown steps ['bogus', 'b0']" in err and "kprof" in err and "retime" in err


def test_train_throughput_image_rows_train_the_vl_model_on_cpu(tmp_path):
    """The native multimodal case's rows (`RandomImageRows`): placeholder runs matching the images' visual tokens,
    no loss on them, deterministic per step; one trainer step of m3-tiny's VL model runs on them."""
    from benchmarks.train_throughput import RandomImageRows
    from openm3.models.config import M3TextConfig
    from openm3.models.multimodal import M3ForConditionalGeneration, M3VLConfig
    from openm3.train.config import TrainConfig
    from openm3.train.trainer import Trainer

    text = M3TextConfig.from_name("m3-tiny")
    vl = M3VLConfig.from_name("m3-tiny", image_token_index=text.vocab_size - 2, video_token_index=text.vocab_size - 1)
    source = RandomImageRows(text.vocab_size, 1024, vl.image_token_index, 2)
    (row,) = source.rows("image", 3, 1)
    assert int((row.input_ids == vl.image_token_index).sum()) == 2 * 256
    assert bool((row.labels[:-1][row.input_ids[1:] == vl.image_token_index] == -100).all())
    assert row.vision["pixel_values"].shape == (2 * 1024, 3 * 2 * 14 * 14)
    assert row.vision["image_grid_thw"].tolist() == [[1, 32, 32]] * 2
    assert torch.equal(source.rows("image", 3, 1)[0].input_ids, row.input_ids)
    assert int((source.rows("text", 3, 1)[0].input_ids >= text.vocab_size - 2).sum()) == 0  # no stray placeholder
    cfg = TrainConfig(model="m3-tiny", steps=1, seq_len=1024, text_rows=1, micro_batch=2, warmup_steps=1,
                      msa_switch_step=0, out_dir=str(tmp_path), progress=False, tensorboard=False, recipe="native",
                      mixture={"text": 1.0, "image": 1.0})
    record = Trainer(cfg, lambda: M3ForConditionalGeneration(vl), source).train_step()
    assert record["loss"] > 0


def test_train_throughput_times_overlapped_steps_as_fit_queues_them(tmp_path, monkeypatch):
    """`time_overlapped`: the steps run back to back with `Trainer.fit`'s order (each next step queued before this
    one's values are read), every step's values read, the same losses as steps run one at a time."""
    from benchmarks.train_throughput import time_overlapped
    from openm3.train.config import TrainConfig
    from openm3.train.trainer import PendingStep, Trainer
    from test_train_toy import ToyLM, ToySource

    cfg = lambda name: TrainConfig(recipe="text-only", steps=4, seq_len=24, text_rows=2, micro_batch=2,  # noqa: E731
                                   warmup_steps=1, msa_switch_step=1,
                                   out_dir=str(tmp_path / name), progress=False, tensorboard=False)
    order, read = [], PendingStep.record

    def recording(self):
        if self._record is None:
            order.append(("read", self.step))
        return read(self)

    t = Trainer(cfg("a"), ToyLM, ToySource())
    launch = t.launch_step
    t.launch_step = lambda: order.append(("launch", t.step)) or launch()
    monkeypatch.setattr(PendingStep, "record", recording)
    assert time_overlapped(t, 3) > 0
    assert order == [("launch", 0), ("launch", 1), ("read", 0), ("launch", 2), ("read", 1), ("read", 2)]
    ref = Trainer(cfg("b"), ToyLM, ToySource())
    ref_losses = [ref.train_step()["loss"] for _ in range(4)]
    assert t.train_step()["loss"] == ref_losses[3]  # the timed steps trained as usual


def test_mean_keys_per_query_counts_what_the_selection_lets_each_query_see():
    """The MFU's attention FLOPs: the mean number of keys a query attends to, against the causal keys inside the
    blocks the reference selection actually picks (lengths not multiples of the block, fewer blocks than topk)."""
    from benchmarks.train_throughput import mean_keys_per_query
    from openm3.ops.msa import reference

    block, topk = 8, 3
    for ctx in (5, 24, 37, 100):
        g = torch.Generator().manual_seed(ctx)
        qi, ki = torch.randn(ctx, 1, 4, generator=g), torch.randn(ctx, 4, generator=g)
        cu = torch.tensor([0, ctx], dtype=torch.int32)
        sel = reference.select_blocks(qi, ki, cu, block_size=block, topk=topk)[0]  # [T, topk]
        seen = [sum(min(block, t + 1 - b * block) for b in sel[t].tolist() if b >= 0) for t in range(ctx)]
        assert mean_keys_per_query(ctx, block, topk) == sum(seen) / ctx
        assert mean_keys_per_query(ctx) == (ctx + 1) / 2


def test_train_throughput_ab_schedule_and_spec():
    """`--ab`: the variant's kernels warm up on the last untimed step, then timed steps alternate A, B, A, B; the
    spec keeps '=' and ',' inside values; the environment is restored after each step."""
    import os

    import pytest

    from benchmarks.train_throughput import ab_variant_step, environment, parse_ab

    assert [ab_variant_step(i, 3) for i in range(9)] == [False, False, True, False, True, False, True, False, True]
    assert parse_ab("OPENM3_KL_LAUNCH=teacher_pass=0;OPENM3_SELECT_LAUNCH=index_lse=1,lse_maxnreg=128") == {
        "OPENM3_KL_LAUNCH": "teacher_pass=0", "OPENM3_SELECT_LAUNCH": "index_lse=1,lse_maxnreg=128"}
    assert parse_ab("") == {}
    with pytest.raises(SystemExit, match="--ab"):
        parse_ab("teacher_pass")
    os.environ.pop("OPENM3_AB_PROBE", None)
    with environment({"OPENM3_AB_PROBE": "1"}):
        assert os.environ["OPENM3_AB_PROBE"] == "1"
    assert "OPENM3_AB_PROBE" not in os.environ
    # cfg.FIELD items: TrainConfig fields, set for the block on the trainer's config
    from openm3.train.config import TrainConfig

    assert parse_ab("cfg.residual_dtype=float32;OPENM3_AB_PROBE=2") == {
        "cfg.residual_dtype": "float32", "OPENM3_AB_PROBE": "2"}
    with pytest.raises(SystemExit, match="TrainConfig field"):
        parse_ab("cfg.no_such_field=1")
    cfg = TrainConfig()
    with environment(parse_ab("cfg.residual_dtype=float32;OPENM3_AB_PROBE=2"), cfg):
        assert cfg.residual_dtype == "float32" and os.environ["OPENM3_AB_PROBE"] == "2"
    assert cfg.residual_dtype == "auto" and "OPENM3_AB_PROBE" not in os.environ
    with environment({"cfg.ac_reuse_msa": "0", "cfg.lr": "0.5"}, cfg):
        assert cfg.ac_reuse_msa is False and cfg.lr == 0.5
    assert cfg.ac_reuse_msa is True and cfg.lr == 3e-3
    with pytest.raises(ValueError, match="bool field"):
        with environment({"cfg.ac_reuse_msa": "yes"}, cfg):
            pass
    with pytest.raises(ValueError, match="need the TrainConfig"):
        with environment({"cfg.residual_dtype": "float32"}):
            pass


def test_long_context_summary_pairs_the_checkpointing_settings(capsys):
    """`train_throughput.summarise_long`: a ratio per setting both models ran, each model's faster setting with
    --long-ckpt both (an out-of-memory case left out), the FLOP ceiling."""
    from benchmarks.train_throughput import summarise_long

    case = lambda tps, flops=1.0: {"tokens_per_s": tps, "overlapped_tokens_per_s": tps * 1.1, "flops_per_token": flops}
    result = {"cases": {"msa_p_64": case(60.0, 1.0), "dense_p_64": case(24.0, 3.0), "msa_p_64_noac": case(72.0, 1.0),
                        "dense_p_64_noac": {"error": "OutOfMemoryError: ...", "out_of_memory": True}}}
    summarise_long(result, "p", 64, "both")
    assert result["msa_over_dense_tokens_per_s"] == 2.5 and "msa_over_dense_noac_tokens_per_s" not in result
    assert result["msa_over_dense_best_tokens_per_s"] == 3.0 and result["msa_over_dense_flop_ratio"] == 3.0
    assert "2.50x (with checkpointing)" in capsys.readouterr().out
    result = {"cases": {"msa_p_64_noac": case(72.0), "dense_p_64_noac": case(30.0, 3.0)}}
    summarise_long(result, "p", 64, "off")
    assert result["msa_over_dense_noac_tokens_per_s"] == 2.4 and "msa_over_dense_best_tokens_per_s" not in result
    assert "2.40x (without checkpointing)" in capsys.readouterr().out


def test_serve_interleave_benchmark_runs_on_cpu(tmp_path, capsys):
    from benchmarks import serve_interleave

    assert serve_interleave.main(["--preset", "m3-tiny", "--device", "cpu", "--short", "16", "--new", "96",
                                  "--long", "96", "--chunk-size", "16", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("serve_interleave_*.json")
    settings = json.loads(path.read_text())["settings"]
    assert settings["interleaved"]["gaps_during_prefill"] >= 5  # A decoded between B's 6 chunks
    assert settings["whole prefill"]["gaps_during_prefill"] <= 2
    capsys.readouterr()
    assert serve_interleave.main(["--preset", "m3-tiny", "--device", "cpu", "--short", "16", "--new", "64",
                                  "--long", "48", "--longs", "2", "--chunk-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "a chunk per group" in out and out.count("time to first token") == 3



def test_speculative_benchmark_runs_on_cpu(tmp_path, capsys):
    """Smoke run: with scripted drafts that are always right every greedy answer stays plain decoding's and
    nearly every draft is kept; the JSON holds each setting."""
    from benchmarks import speculative_decode

    assert speculative_decode.main(["--preset", "m3-tiny", "--device", "cpu", "--prompt", "64", "--new", "10",
                                    "--drafts", "3", "--alphas", "1.0", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("speculative_decode_b1_*.json")
    result = json.loads(path.read_text())
    scripted = [s for s in result["settings"] if s["name"] == "scripted"]
    assert len(scripted) == 1 and scripted[0]["same_tokens"]
    assert scripted[0]["tokens_per_step"] > 2 and scripted[0]["decode_steps"] < result["plain"]["decode_steps"]
    assert "n-gram lookup over 74 tokens" in capsys.readouterr().out


def test_ngram_acceptance_benchmark_runs_on_cpu(tmp_path):
    """Smoke run on two stdlib documents: rewriting a file it was shown keeps far more drafts than continuing it."""
    from benchmarks import ngram_acceptance

    shares = {}
    for task in ("continue", "rewrite"):
        assert ngram_acceptance.main(["--task", task, "--corpora", "stdlib", "--docs", "2", "--drafts", "4",
                                      "--lookup-min", "2", "--max-tokens", "1024", "--out", str(tmp_path)]) == 0
        (path,) = tmp_path.glob(f"ngram_acceptance_{task}_*.json")
        (row,) = json.loads(path.read_text())["corpora"]["stdlib"]
        assert row["docs"] == 2 and row["steps"] <= row["tokens"] and 0 <= row["kept_share"] <= 1
        shares[task] = row["tokens_per_step"]
    assert shares["rewrite"] > shares["continue"] + 0.5
