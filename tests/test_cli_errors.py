"""The command lines' rough edges: `openm3 generate`, `openm3 serve` and `openm3 smoke` refuse a device this machine
lacks (and `serve` a port out of range) with one line naming the option, show their defaults in --help, report a
generation without decode steps without NaNs, and `serve` says what it serves before it listens."""

import os

import pytest
import torch

from openm3.cli import main as openm3_main
from openm3.data.tokenizer import TokenizerSettings, get_tokenizer
from openm3.engine.generate import GenerationStats, build_parser as generate_parser, check_device, main as generate
from openm3.serve.cli import build_parser as serve_parser

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def no_cuda(monkeypatch):
    """A machine without CUDA, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def flat(text: str) -> str:
    return " ".join(text.split())  # argparse wraps help text anywhere


def test_check_device_names_the_option(no_cuda):
    assert check_device("cpu") == torch.device("cpu") and check_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^--device cuda: CUDA is not available on this machine \(.*\); use "
                       r"--device cpu$"):
        check_device("cuda")
    with pytest.raises(ValueError, match=r"^--device: expected a torch device such as cpu, cuda or cuda:1, got "
                       r"'gpu'$"):
        check_device("gpu")


def test_commands_refuse_a_cuda_device_the_machine_lacks(no_cuda, capsys):
    """One line naming --device, before any model is built, from each command that takes it."""
    with pytest.raises(SystemExit, match=r"^error: --device cuda: CUDA is not available"):
        generate(["--preset", "m3-tiny", "--prompt-ids", "1", "--device", "cuda"])
    assert openm3_main(["smoke", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("openm3 smoke: error: --device cuda: CUDA is not available")
    from openm3.serve.cli import main as serve

    with pytest.raises(SystemExit, match=r"^error: --device cuda:0: CUDA is not available"):
        serve(["--preset", "m3-tiny", "--device", "cuda:0"])


@pytest.mark.parametrize("value", ["99999", "-1", "http"])
def test_serve_port_is_checked_by_the_parser(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_parser().parse_args(["--preset", "m3-tiny", "--port", value])
    assert exit_.value.code == 2
    assert "argument --port: expected a port number 0-65535, got " in capsys.readouterr().err
    assert serve_parser().parse_args(["--preset", "m3-tiny", "--port", "0"]).port == 0


def test_help_shows_the_defaults():
    text = flat(generate_parser().format_help())
    assert "tokens to generate at most (default: 32)" in text and "0 = greedy (default: 0.0)" in text
    text = flat(serve_parser().format_help())
    for shown in ("(default: 127.0.0.1)", "0-65535 (default: 8000)", "vLLM's name; default: 8)"):
        assert shown in text


def test_generate_checks_chunk_size_before_the_progress_bar(capsys):
    with pytest.raises(SystemExit, match=r"^error: --chunk-size: expected >= 1, got 0$"):
        generate(["--preset", "m3-tiny", "--prompt-ids", "1,2,3", "--chunk-size", "0", "--device", "cpu"])
    with pytest.raises(SystemExit, match=r"^error: --max-new-tokens: expected >= 1, got 0$"):
        generate(["--preset", "m3-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "0", "--device", "cpu"])
    assert "prefill" not in capsys.readouterr().err


def test_generate_with_a_preset_takes_the_tokenizer_serve_takes(capsys):
    """`--preset` with `--prompt` and no `--tokenizer`: openm3's own tokenizer, as `openm3 serve --preset`."""
    text = "def main():\n    return"
    assert generate(["--preset", "m3-tiny", "--prompt", text, "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert f"prompt tokens {len(get_tokenizer().encode(text))}," in capsys.readouterr().err


def test_generate_from_a_checkpoint_without_a_tokenizer_asks_for_one(tmp_path):
    from openm3.models import M3TextConfig, M3TextModel

    M3TextModel(M3TextConfig.from_name("m3-tiny")).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(SystemExit, match=f"--prompt needs --tokenizer PATH: {tmp_path / 'ckpt'} holds no "
                                         f"tokenizer.json"):
        generate(["--checkpoint", str(tmp_path / "ckpt"), "--prompt", "hi", "--device", "cpu"])
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # an `openm3 train` run folder: that is the error
    with pytest.raises(SystemExit, match="--checkpoint: .*run: no config.json there, so not a model checkpoint but "
                                         "a training run's folder"):
        generate(["--checkpoint", str(tmp_path / "run"), "--prompt", "hi", "--device", "cpu"])


@pytest.mark.parametrize("new,line", [
    (1, "decode: no decode steps (each sequence ended with the token sampled after prefill)"),
    (2, "decode: 1 token in "),
])
def test_generate_report_without_decode_steps_reads_well(new, line, capsys):
    """max_new_tokens 1: prefill samples the only token; 2: one decode step, nothing after it to time."""
    argv = ["--preset", "m3-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", str(new), "--device", "cpu"]
    assert generate(argv) == 0
    err = capsys.readouterr().err
    assert line in err and "nan" not in err
    assert ("no later steps to time" in err) == (new == 2)


def test_stats_summary_without_decode_tokens():
    text = GenerationStats(prompt_tokens=3, ttft_s=0.5).summary()
    assert "no decode steps" in text and "nan" not in text
    one = GenerationStats(prompt_tokens=3, ttft_s=0.5, decode_tokens=1, decode_s=0.1, first_step_s=0.1,
                          first_step_tokens=1, decode_steps=1).summary()
    assert "decode: 1 token in 0.100 s = 10.00 tokens/s (first step 0.100 s; no later steps to time)" in one


def test_serve_says_what_it_serves_before_it_listens(tmp_path, monkeypatch, capsys):
    """`openm3 serve` prints the model, its source, size, dtype and device, the limits and the tokenizer, then
    starts uvicorn (stubbed here)."""
    import uvicorn

    tok = get_tokenizer(TokenizerSettings(vocab_size=1024, chars_per_corpus=150_000), tmp_path / "cache")
    path = tok.save(tmp_path / "tok")
    ran = []
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port: ran.append((host, port)))
    from openm3.serve.cli import main as serve

    assert serve(["--preset", "m3-tiny", "--tokenizer", str(path), "--max-total-tokens", "64", "--max-batch", "2",
                  "--device", "cpu", "--port", "0", "--disable-log-stats", "--model-name", "tiny", "alias"]) == 0
    assert ran == [("127.0.0.1", 0)]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("openm3 serve: 'tiny' / 'alias' = preset m3-tiny with random weights (seed 0): ")
    assert lines[0].endswith("M parameters, float32 on cpu")
    assert lines[1] == (f"  requests: at most 64 tokens each, up to 2 at once in a 128-token cache; tokenizer: "
                        f"{path} (1024 tokens)")


def test_smoke_reads_a_checkpoint_with_its_tokenizer(tmp_path, capsys):
    """`openm3 smoke --checkpoint` with a tokenizer.json beside the weights encodes the prompt and names the top
    tokens with it (a random preset keeps byte-level ids); `--preset` is `--config`'s name elsewhere."""
    from openm3.models import M3TextConfig, M3TextModel

    tok = get_tokenizer()
    M3TextModel(M3TextConfig.from_name("m3-tiny", vocab_size=tok.vocab_size)).save_pretrained(tmp_path / "ckpt")
    tok.save(tmp_path / "ckpt")
    assert openm3_main(["smoke", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "def main():"]) == 0
    out = capsys.readouterr().out
    assert f"-> {len(tok.encode('def main():'))} token ids of its tokenizer.json;" in out
    assert openm3_main(["smoke", "--preset", "m3-tiny", "--prompt", "abc"]) == 0
    assert "-> 3 byte-level token ids;" in capsys.readouterr().out
    threads = torch.get_num_threads()
    try:
        assert openm3_main(["smoke", "--prompt", "abc", "--threads", "1"]) == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert openm3_main(["smoke", "--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
    assert openm3_main(["smoke", "--prompt", "abc", "--layers", "2"]) == 0
    assert "2 layers (1 full_attention, 1 minimax_m3_sparse; MLP: 1 dense, 1 sparse)" in capsys.readouterr().out
    assert openm3_main(["smoke", "--checkpoint", str(tmp_path / "ckpt"), "--layers", "2"]) == 2
    assert "--layers: only with --preset" in capsys.readouterr().err


def test_generate_and_serve_take_cpu_threads(capsys, monkeypatch):
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    assert generate(["--preset", "m3-tiny", "--prompt-ids", "1,2", "--max-new-tokens", "1", "--device", "cpu",
                     "--threads", "1"]) == 0
    assert set_to == [1] and serve_parser().parse_args(["--preset", "m3-tiny", "--threads", "2"]).threads == 2
    with pytest.raises(SystemExit, match="--threads must be >= 1, got 0"):
        generate(["--preset", "m3-tiny", "--prompt-ids", "1", "--device", "cpu", "--threads", "0"])


@pytest.mark.parametrize("threads", ["0", "-1"])
@pytest.mark.parametrize("command, rest", [
    ("smoke", []), ("generate", ["--preset", "m3-tiny", "--prompt-ids", "1", "--device", "cpu"]),
    ("serve", ["--preset", "m3-tiny", "--device", "cpu"]), ("eval", ["--checkpoint", "{tmp}/missing"]),
    ("train", ["--out", "{tmp}/run", "--steps", "2"]), ("demo", ["--out", "{tmp}/report", "--steps", "1"]),
])
def test_every_command_refuses_threads_below_one_alike(command, rest, threads, tmp_path, capsys, monkeypatch):
    """One check (`openm3.threads`) for every command taking --threads: the same line, exit status 2, before any
    work (eval's before its --checkpoint is read; train's and demo's before their --out is made)."""
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    argv = [command, *(a.format(tmp=tmp_path) for a in rest), "--threads", threads]
    assert openm3_main(argv) == 2
    assert capsys.readouterr().err.endswith(f"openm3 {command}: error: --threads must be >= 1, got {threads}\n")
    assert set_to == [] and list(tmp_path.iterdir()) == []


def test_threads_defaults_are_each_commands_own():
    """demo runs one thread unless told (its tiny model gains nothing from more); the others leave torch's."""
    from openm3.cli import build_parser as openm3_parser
    from openm3.demo import parse_args as demo_args
    from openm3.eval_cli import parse_args as eval_args
    from openm3.train.cli import build_parser as train_parser

    assert demo_args([]).threads == 1
    assert openm3_parser().parse_args(["smoke"]).threads is None
    assert generate_parser().parse_args(["--preset", "m3-tiny", "--prompt-ids", "1"]).threads is None
    assert serve_parser().parse_args(["--preset", "m3-tiny"]).threads is None
    assert eval_args(["--checkpoint", "c"]).threads is None and train_parser().parse_args([]).threads is None


@pytest.fixture
def tiny_checkpoint(tmp_path):
    from openm3.models import M3TextConfig, M3TextModel

    return M3TextModel(M3TextConfig.from_name("m3-tiny")).save_pretrained(tmp_path / "ckpt")


def test_a_cut_short_shard_is_named_not_a_traceback(tiny_checkpoint, capsys):
    """A shard cut short (an interrupted copy or download) is one line naming the file, from every loader."""
    shard = next(tiny_checkpoint.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(1000)
    assert openm3_main(["smoke", "--checkpoint", str(tiny_checkpoint)]) == 2
    assert f"{shard}: not a readable safetensors file (" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not a readable safetensors file"):
        generate(["--checkpoint", str(tiny_checkpoint), "--prompt-ids", "1", "--device", "cpu"])


def test_convert_checks_its_target_and_shard_size_before_loading(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert openm3_main(["convert", str(tmp_path / "none"), str(tmp_path / "file")]) == 2
    assert "target: " in capsys.readouterr().err
    assert openm3_main(["convert", str(tmp_path / "none"), str(tmp_path / "out"), "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size: expected a positive size such as 5GB or 500MB, got 'lots'" in capsys.readouterr().err


def test_convert_refuses_a_target_inside_its_source(tiny_checkpoint, monkeypatch, capsys):
    """`convert SRC SRC/sub` wrote the conversion (and its hidden work folder) into the checkpoint it read: refused
    before anything loads, naming both directories, as SRC itself is."""
    import openm3.models

    def load(*_, **__):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(openm3.models, "load_pretrained", load)
    before = sorted(p.name for p in tiny_checkpoint.iterdir())
    for target, where in ((tiny_checkpoint / "sub", "inside"), (tiny_checkpoint / "sub" / "sub", "inside"),
                          (tiny_checkpoint / ".." / tiny_checkpoint.name, "the source directory")):
        assert openm3_main(["convert", str(tiny_checkpoint), str(target), "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"openm3 convert: error: target: {target} is {where}") and str(tiny_checkpoint) in err
    assert sorted(p.name for p in tiny_checkpoint.iterdir()) == before


def test_generate_refuses_what_it_would_ignore(tiny_checkpoint):
    """--layers with --checkpoint, and a 0 --token-budget / --max-total-tokens (read as "not given"), are refused."""
    base = ["--checkpoint", str(tiny_checkpoint), "--prompt-ids", "1,2", "--device", "cpu", "--max-new-tokens", "1"]
    with pytest.raises(SystemExit, match="--layers: only with --preset"):
        generate(base + ["--layers", "2"])
    for flag in ("--token-budget", "--max-total-tokens"):
        with pytest.raises(SystemExit, match=f"^error: {flag}: expected >= 1, got 0$"):
            generate(base + [flag, "0"])


def test_check_device_refuses_devices_that_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="^--device meta: a meta device holds no values"):
        check_device("meta")
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    with pytest.raises(ValueError, match="^--device xpu: xpu is not available on this machine; use --device cpu$"):
        check_device("xpu")


def test_smoke_topk_beyond_the_vocabulary(capsys):
    assert openm3_main(["smoke", "--topk", "100000"]) == 2
    assert "--topk must be at most the model's vocab_size=" in capsys.readouterr().err


def test_eval_out_under_a_file_fails_before_the_evaluation(tmp_path):
    from openm3.eval_cli import check_args, parse_args

    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--out: cannot write .*file.*is a file, not a directory"):
        check_args(parse_args(["--checkpoint", "x", "--out", str(tmp_path / "file" / "r.json")]))


def test_demo_settings_fail_before_the_last_report_is_deleted(tmp_path, capsys):
    from openm3.demo import demo_config, parse_args

    demo_config(parse_args(["--steps", "1"]))  # the schedule it derives is valid at one step
    (tmp_path / "report" / "checkpoints").mkdir(parents=True)
    (tmp_path / "report" / "metrics.json").write_text("{}")
    assert openm3_main(["demo", "--out", str(tmp_path / "report"), "--lr", "-1"]) == 2
    assert "--lr and --vision-lr-scale must be > 0" in capsys.readouterr().err
    assert (tmp_path / "report" / "checkpoints").is_dir() and (tmp_path / "report" / "metrics.json").is_file()
    (tmp_path / "file").write_text("x")
    assert openm3_main(["demo", "--out", str(tmp_path / "file")]) == 2
    assert "--out: cannot make the report folder" in capsys.readouterr().err


def test_bench_processes_find_the_benchmarks(monkeypatch):
    """A benchmark that starts processes (`python -m benchmarks.NAME` under torchrun) from another directory: they
    get the checkout on PYTHONPATH; the variable is put back afterwards."""
    import runpy

    from openm3.bench_cli import benchmarks_dir, main as bench

    seen = []
    monkeypatch.setattr(runpy, "run_module", lambda *a, **k: seen.append(os.environ.get("PYTHONPATH")))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert bench(["train_distributed"]) == 0
    assert seen == [os.pathsep.join([str(benchmarks_dir().parent), "/elsewhere"])]
    assert os.environ["PYTHONPATH"] == "/elsewhere"


def test_interrupt_and_file_errors_are_one_line(tmp_path, monkeypatch, capsys):
    import openm3.data.cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(openm3.data.cli, "main", interrupted)
    try:
        code = openm3_main(["data"])
    except KeyboardInterrupt:  # would stop this pytest session
        pytest.fail("Ctrl-C escaped openm3's main as a traceback")
    assert code == 130
    assert capsys.readouterr().err.strip() == "openm3 data: interrupted"
    monkeypatch.undo()
    (tmp_path / "file").write_text("x")
    assert openm3_main(["data", "preview", "--out", str(tmp_path / "file")]) == 1
    assert capsys.readouterr().err.startswith("openm3 data: error: [Errno 17] File exists: ")


def test_sampling_options_have_help():
    text = flat(generate_parser().format_help())
    for shown in ("1 = off (default: 1.0)", "0 = off (default: 0)", "--random-prompt (default: 0)"):
        assert shown in text


def test_generate_errors_exit_as_the_other_commands_do(capsys):
    """`openm3 generate`'s own errors exited 1 (a SystemExit message) where the other commands' exit 2."""
    from openm3.cli import main

    assert main(["generate", "--preset", "m3-tiny", "--random-prompt", "8", "--chunk-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "openm3 generate: error: --chunk-size: expected >= 1, got 0"
    assert main(["eval", "--checkpoint", "/nonexistent/ckpt"]) == 2  # (what the others give)


def test_negative_numbers_in_scientific_notation_are_values(tmp_path, capsys):
    """argparse read `--lr -1e-3` as an unknown option `-1e-3` ("expected one argument"): every command's parser
    takes it as the flag's value now, as it took -1 and -.5."""
    from openm3 import cli
    from openm3.demo import parse_args as demo_args
    from openm3.train.cli import parse_args as train_args

    args = generate_parser().parse_args(["--preset", "m3-tiny", "--random-prompt", "4", "--presence-penalty", "-1e-1",
                                         "--frequency-penalty", "-2E+0", "--seed", "-1"])
    assert (args.presence_penalty, args.frequency_penalty, args.seed) == (-0.1, -2.0, -1)
    assert train_args(["--lr", "-1e-3", "--kl-weight", "-.5"]).lr == -1e-3
    assert demo_args(["--lr", "-3.e-3"]).lr == -3e-3
    assert serve_parser().parse_args(["--preset", "m3-tiny", "--log-stats-interval", "-1e1"]).log_stats_interval == -10
    with pytest.raises(SystemExit):  # an option is still an option
        train_args(["--lr", "-e3"])
    assert "--lr: expected one argument" in capsys.readouterr().err
    parsers = [cli._load(builder)() for _, _, builder in cli._DELEGATED.values() if builder]
    assert len(parsers) == 5 and all(isinstance(p, cli.ArgumentParser) for p in parsers + [cli.build_parser()])
    assert openm3_main(["demo", "--out", str(tmp_path / "report"), "--lr", "-1e-3"]) == 2  # the library's check
    assert capsys.readouterr().err.strip() == ("openm3 demo: error: --lr and --vision-lr-scale must be > 0, got "
                                               "-0.001, 0.1")


def test_library_checks_name_the_flags_they_were_given_as(tmp_path, capsys):
    """A check of the library a command passes its flags to named the library's argument (`top_p must be in (0,
    1]`): `openm3` names the flag, the library keeps its own words."""
    from openm3.engine.sampling import SamplingParams

    base = ["generate", "--preset", "m3-tiny", "--random-prompt", "4", "--device", "cpu"]
    for flags, told in ((["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
                        (["--presence-penalty", "-3"], "--presence-penalty must be a number in [-2, 2], got -3.0"),
                        (["--temperature", "-1e-3"], "--temperature must be a finite number >= 0 (0 = greedy), got "
                                                     "-0.001")):
        assert openm3_main(base + flags) == 2
        assert capsys.readouterr().err.strip() == f"openm3 generate: error: {told}"
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 2$"):
        SamplingParams(top_p=2)
    out = str(tmp_path / "run")
    assert openm3_main(["train", "--out", out, "--lr", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "openm3 train: error: --lr and vision_lr_scale must be > 0, got -1.0, 1.0"
    settings = tmp_path / "run.json"
    settings.write_text('{"lr": -1}')  # from the settings file, not a flag: its field's name
    assert openm3_main(["train", "--out", out, "--config", str(settings)]) == 2
    assert capsys.readouterr().err.strip() == "openm3 train: error: lr and vision_lr_scale must be > 0, got -1, 1.0"
    assert openm3_main(["demo", "--out", out, "--vision-lr-scale", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("openm3 demo: error: --lr and --vision-lr-scale must be > 0, got 0.003, "
                                               "0.0")
    with pytest.raises(SystemExit):  # a mixture of -1 video rows: its own check named the mixture
        openm3_main(["demo", "--out", out, "--video-rows", "-1"])
    assert "--video-rows must be >= 0" in capsys.readouterr().err
