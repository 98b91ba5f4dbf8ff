"""Training system: schedule, recipes, config validation, batching, losses, and exact resume."""

import json
import time

import pytest
import torch

from openm3.train.batches import IGNORE, Row, collate, shard_micro_batches
from openm3.train.checkpoint import latest_checkpoint
from openm3.train.config import TrainConfig
from openm3.train.losses import lm_loss_sum, load_balancing_loss
from openm3.train.metrics import read_jsonl
from openm3.train.recipes import make_plan
from openm3.train.schedule import WSDSchedule
from openm3.train.trainer import Trainer
from test_train_toy import ToyLM, ToySource


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def toy_cfg(tmp_path, name="run", **kw):
    base = dict(recipe="text-only", steps=8, seq_len=24, text_rows=4, micro_batch=2, lr=1e-2, warmup_steps=2,
                msa_switch_step=3, out_dir=str(tmp_path / name), progress=False, tensorboard=False)
    return TrainConfig(**(base | kw))


# ---- schedule and recipes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd_schedule_phases(shape):
    s = WSDSchedule(total_steps=20, warmup_steps=4, decay_start=10, min_lr_ratio=0.1, decay_shape=shape)
    values = [s(i) for i in range(20)]
    assert values[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert values[4:10] == [1.0] * 6
    assert all(a >= b for a, b in zip(values[10:], values[11:]))  # monotone decay
    assert values[-1] == pytest.approx(0.1)
    assert values[10] < 1.0


def test_decay_before_warmup_fails():
    with pytest.raises(ValueError, match="decay_start"):
        WSDSchedule(total_steps=20, warmup_steps=10, decay_start=5)
    with pytest.raises(ValueError, match="decay_start"):
        TrainConfig(steps=20, warmup_steps=10, decay_start=5)


def test_unknown_recipe_fails():
    with pytest.raises(ValueError, match="recipe must be one of"):
        TrainConfig(recipe="vision-first")


@pytest.mark.parametrize("recipe", ["text-only", "native", "mid", "cpt"])
def test_recipes_share_the_text_budget(recipe):
    plan = make_plan(recipe, steps=50, text_rows=4, warmup_steps=5, decay_start=40)
    assert all(plan.rows(s)["text"] == 4 for s in range(50))
    assert plan.text_token_budget(128) == 50 * 4 * 128
    vision_steps = [s for s in range(50) if plan.rows(s)["image"] > 0]
    first = vision_steps[0] if vision_steps else None
    expected_first = {"text-only": None, "native": 0, "mid": 20, "cpt": 40}[recipe]
    assert first == expected_first
    if vision_steps:
        assert vision_steps == list(range(first, 50))
    if recipe == "mid":
        assert first < plan.schedule.decay_start
    if recipe == "cpt":  # the main schedule has fully decayed when vision arrives
        assert plan.lr_multiplier(39) == pytest.approx(plan.schedule.min_lr_ratio)
        assert plan.lr_multiplier(45) == pytest.approx(plan.cpt_lr_ratio)


def test_mid_recipe_must_start_before_decay():
    with pytest.raises(ValueError, match="vision_start_step"):
        make_plan("mid", steps=50, text_rows=4, warmup_steps=5, decay_start=40, vision_start_step=45)


def test_batch_not_divisible_by_world_size_fails_before_compute(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "3")  # 4 text rows per step
    built = []
    with pytest.raises(ValueError, match="not divisible by world_size"):
        Trainer(toy_cfg(tmp_path), lambda: built.append(1) or ToyLM(), ToySource())
    assert built == []  # failed before building the model


def test_bad_mixture_fails():
    with pytest.raises(ValueError, match="unknown data kinds"):
        TrainConfig(mixture={"text": 1.0, "audio": 0.5})


# ---- batching and losses -------------------------------------------------------------------------------------
def test_collate_packs_documents():
    rows = ToySource(seq_len=24).rows("text", 0, 3)
    b = collate(rows)
    assert b.input_ids.shape == (72,)
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens[-1] == 72 and len(b.cu_seqlens) == 7
    starts = b.cu_seqlens[:-1].long()
    assert (b.position_ids[starts] == 0).all()
    assert b.num_loss_tokens == 72 - 6  # the last token of every document has no target


def test_row_validation():
    with pytest.raises(ValueError, match="doc_lens"):
        Row(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), [2, 2])


def test_sharding_covers_every_row_once():
    rows = ToySource().rows("text", 0, 8)
    ids = [r.input_ids for r in rows]
    got = [b.input_ids for rank in range(2) for b in shard_micro_batches(rows, rank, 2, 2)]
    assert torch.equal(torch.sort(torch.cat(got)).values, torch.sort(torch.cat(ids)).values)
    with pytest.raises(ValueError):
        shard_micro_batches(rows, 0, 3, 1)
    assert [b.num_tokens for b in shard_micro_batches(rows, 0, 1, 3)] == [72, 72, 48]


def test_lm_loss_sum_matches_mean_ce():
    logits = torch.randn(10, 7)
    labels = torch.randint(0, 7, (10,))
    labels[3] = IGNORE
    ref = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE) * 9
    assert lm_loss_sum(logits, labels).item() == pytest.approx(ref.item(), rel=1e-6)


def test_load_balancing_loss_is_one_when_balanced_and_larger_when_not():
    uniform = torch.full((8, 4), 0.25)
    balanced = torch.arange(8).remainder(4)[:, None]
    assert load_balancing_loss(uniform, balanced).item() == pytest.approx(1.0)
    skewed_p = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    assert load_balancing_loss(skewed_p, torch.zeros(8, 1, dtype=torch.long)).item() == pytest.approx(2.8)


# ---- the loop ------------------------------------------------------------------------------------------------
def test_training_reduces_loss_and_logs(tmp_path):
    cfg = toy_cfg(tmp_path, steps=25)
    t = Trainer(cfg, ToyLM, ToySource())
    hist = t.fit()
    first, last = hist[0]["loss"], hist[-1]["loss"]
    assert last < 0.6 * first, (first, last)
    assert [r["msa_stage"] for r in hist[:4]] == ["dense", "dense", "dense", "sparse"]
    log = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in log if "loss" in r] == list(range(25))
    assert {"lr", "tokens_per_s", "indexer_kl", "aux_loss", "grad_norm"} <= set(log[0])
    written = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert written["warmup_steps"] == 2 and written["decay_start"] is None  # given / derived from steps


def test_out_of_vocabulary_ids_fail_on_the_host_before_the_forward(tmp_path):
    """The trainer checks each micro-batch's ids on the host (the model then skips its own read-back, a device
    sync on a GPU): ids past an openm3 model's vocabulary fail with a message naming input_ids, and the model's
    own check is back on afterwards."""
    from openm3.models import M3TextConfig, M3TextModel

    small_vocab = lambda: M3TextModel(M3TextConfig.from_name("m3-tiny", vocab_size=32))  # noqa: E731
    t = Trainer(toy_cfg(tmp_path), small_vocab, ToySource())  # the toy data uses ids up to 63
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=32\)"):
        t.train_step()
    assert not t.model.input_ids_prechecked


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                                "8589934592 bytes")], ids=["cuda", "cpu"])
def test_running_out_of_memory_says_what_to_change(tmp_path, monkeypatch, error):
    """Out of memory in a step (CUDA's error, or the CPU allocator's RuntimeError) is an OutOfMemoryError naming
    the settings that would lower the memory, with the original error chained; other errors pass unchanged."""
    t = Trainer(toy_cfg(tmp_path, steps=4), ToyLM, ToySource())
    step = t.launch_step

    def failing():
        if t.step == 2:
            raise error
        return step()

    monkeypatch.setattr(t, "launch_step", failing)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        t.fit()
    message = str(caught.value)
    assert "after 2 completed steps" in message and "2 rows of 24 tokens" in message
    assert "--micro-batch (now 2" in message and "--activation-checkpointing" in message and "--seq-len" in message
    assert ("more GPUs" in message) == isinstance(error, torch.OutOfMemoryError)
    assert caught.value.__cause__ is error
    other = Trainer(toy_cfg(tmp_path, "other", steps=4), ToyLM, ToySource())
    monkeypatch.setattr(other, "launch_step", lambda: (_ for _ in ()).throw(RuntimeError("something else")))
    with pytest.raises(RuntimeError, match="^something else$"):
        other.fit()


def test_a_failing_evaluation_loses_no_training(tmp_path):
    """The checkpoint of a step goes to disk before that step's evaluation: an evaluation that fails leaves the
    trained steps resumable."""

    def evaluator(trainer, step):
        raise RuntimeError("evaluation broke")

    t = Trainer(toy_cfg(tmp_path, steps=3), ToyLM, ToySource(), evaluator=evaluator)
    with pytest.raises(RuntimeError, match="evaluation broke"):
        t.fit()
    assert latest_checkpoint(t.checkpoints.root).name == "step_00000003"
    again = Trainer(toy_cfg(tmp_path, steps=3), ToyLM, ToySource())
    assert again.resume() and again.step == 3


def test_an_evaluation_cut_short_runs_again_on_resume(tmp_path):
    """A crash in the evaluation after a checkpoint (written first) leaves the step without its evaluation: the
    resumed run evaluates it before going on, at the last step too; one that was logged is not redone."""
    calls = []

    def evaluator(trainer, step):
        calls.append(step)
        if len(calls) == 1:
            raise RuntimeError("killed mid-evaluation")
        return {"score": float(step)}

    cfg = toy_cfg(tmp_path, steps=4, eval_every=2, ckpt_every=2)
    with pytest.raises(RuntimeError, match="killed"):
        Trainer(cfg, ToyLM, ToySource(), evaluator=evaluator).fit()
    again = Trainer(cfg, ToyLM, ToySource(), evaluator=evaluator)
    assert again.resume() and again.step == 2
    again.fit()
    assert calls == [2, 2, 4]
    evals = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "eval/score" in r]
    assert evals == [1, 3]
    done = Trainer(cfg, ToyLM, ToySource(), evaluator=evaluator)
    assert done.resume() and done.step == 4
    done.fit()
    assert calls == [2, 2, 4]  # logged already: not again


def test_a_new_run_refuses_a_folder_with_checkpoints_and_starts_its_log_anew(tmp_path):
    """A new run (no resume) in a folder holding another run's checkpoints is refused (it would prune them as it
    saved its own, and a later resume would find theirs); in a folder holding only the log of an attempt that
    crashed before its first checkpoint it starts the log anew (no steps twice)."""
    cfg = toy_cfg(tmp_path, steps=2)
    log = tmp_path / "run" / "metrics.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text(json.dumps({"step": 0, "loss": 9.0}) + "\n" + json.dumps({"step": 1, "loss": 9.0}) + "\n")
    Trainer(cfg, ToyLM, ToySource()).fit()
    assert [r["step"] for r in read_jsonl(log) if "loss" in r] == [0, 1]
    assert all(r["loss"] != 9.0 for r in read_jsonl(log))
    settings = (tmp_path / "run" / "train_config.json").read_text()
    with pytest.raises(ValueError, match="holds checkpoints of another run .latest: step_00000002.*resume"):
        Trainer(toy_cfg(tmp_path, steps=2, lr=0.5), ToyLM, ToySource()).fit()
    assert (tmp_path / "run" / "train_config.json").read_text() == settings  # the other run's, untouched


def test_a_metrics_line_cut_short_is_dropped(tmp_path):
    """A last line cut short (a crash or a full disk mid-write) is dropped with a warning; a bad line before the
    last one is an error naming the file and line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo')
    with pytest.warns(UserWarning, match="line 2 is not whole JSON"):
        assert read_jsonl(path) == [{"step": 0, "loss": 1.0}]
    path.write_text('{"step": 0, "lo\n{"step": 1, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl: line 1 is not JSON"):
        read_jsonl(path)


def test_pruning_keeps_the_checkpoint_just_written(tmp_path):
    """The newest `keep` checkpoints stay, the one just written always among them (checkpoints of steps that sort
    after it, from another run, used to make it the first deleted), and a pruned one loses its mark first."""
    from openm3.train.checkpoint import CheckpointManager
    from openm3.train.distributed import DistInfo

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(tmp_path, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                                keep=2)
    for step in (5, 6, 3):
        manager.save(step, model, opt, {"step": step})
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000006"]
    assert latest_checkpoint(tmp_path).name == "step_00000003"


def test_a_training_checkpoint_is_on_disk_before_its_name_is(tmp_path, monkeypatch):
    """Power loss: DCP's shards, the RNG and trainer state and meta.json are fsynced before the rename that
    completes the checkpoint; the run folder's names after it, and LATEST is replaced the same way."""
    from test_checkpoint_write import assert_published_synced, record_syncs

    from openm3.train.checkpoint import CheckpointManager
    from openm3.train.distributed import DistInfo

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(tmp_path, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    events = record_syncs(monkeypatch)
    final = manager.save(4, model, opt, {"step": 4})
    assert {p.name for p in final.iterdir()} >= {"meta.json", "trainer_state.pt", "rng_rank0.pt", ".metadata"}
    assert_published_synced(events, final)
    assert_published_synced(events, tmp_path / "LATEST")


def test_a_latest_pointer_to_a_missing_checkpoint_is_said(tmp_path):
    """LATEST naming a checkpoint deleted from outside: the newest complete one is taken, with a warning."""
    from openm3.train.checkpoint import CheckpointManager
    from openm3.train.distributed import DistInfo

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(tmp_path, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    for step in (1, 2):
        manager.save(step, model, opt, {"step": step})
    (tmp_path / "LATEST").write_text("step_00000009")
    with pytest.warns(UserWarning, match="names step_00000009, which is not a complete checkpoint; taking the "
                                         "newest complete one, step_00000002"):
        assert latest_checkpoint(tmp_path).name == "step_00000002"


def test_micro_batch_size_does_not_change_the_update(tmp_path):
    b = Trainer(toy_cfg(tmp_path, "b", steps=3, micro_batch=4, aux_loss_weight=0.0, kl_weight=0.0), ToyLM,
                ToySource()).fit()
    c = Trainer(toy_cfg(tmp_path, "c", steps=3, micro_batch=1, aux_loss_weight=0.0, kl_weight=0.0), ToyLM,
                ToySource()).fit()
    # LM loss is normalised by the global token count, so accumulation granularity does not matter
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in c], abs=1e-5)


def test_resume_is_exact_and_ignores_an_interrupted_checkpoint(tmp_path):
    steps = 8
    full = Trainer(toy_cfg(tmp_path, "full", steps=steps), ToyLM, ToySource()).fit()

    cfg = toy_cfg(tmp_path, "cut", steps=steps, ckpt_every=3)
    first = Trainer(cfg, ToyLM, ToySource())
    first.fit(until=5)  # checkpoint at step 3; steps 3 and 4 are logged, then the process "dies"
    assert latest_checkpoint(tmp_path / "cut" / "checkpoints").name == "step_00000003"

    # a checkpoint that dies mid-write (shards written, never completed) must leave step 3 current
    def crash():
        raise RuntimeError("killed while writing")
    with pytest.raises(RuntimeError):
        first.save_checkpoint(_after_shards=crash)
    assert (tmp_path / "cut" / "checkpoints" / "step_00000005.tmp").exists()
    assert latest_checkpoint(tmp_path / "cut" / "checkpoints").name == "step_00000003"
    del first

    second = Trainer(cfg, ToyLM, ToySource())
    assert second.resume()
    assert second.step == 3
    rest = second.fit()
    assert [r["step"] for r in rest] == list(range(3, steps))
    assert [r["loss"] for r in rest] == [r["loss"] for r in full[3:]]  # exactly equal
    assert [r["grad_norm"] for r in rest] == [r["grad_norm"] for r in full[3:]]
    log = [r for r in read_jsonl(tmp_path / "cut" / "metrics.jsonl") if "loss" in r]
    assert [r["loss"] for r in log] == [r["loss"] for r in full]  # the log holds one clean history
    assert not (tmp_path / "cut" / "checkpoints" / "step_00000005.tmp").exists()  # cleaned by the next save


def test_prefetched_rows_change_nothing(tmp_path):
    """prefetch=on builds each next step's rows in a background thread while the step runs: the same losses as
    without, exactly, from the same rows; the source's error reaches the training loop at its step."""
    import threading

    class Recording(ToySource):
        def __init__(self, fail_at=None):
            super().__init__(seq_len=24)
            self.threads, self.fail_at = {}, fail_at

        def rows(self, kind, step, count):
            self.threads[step] = threading.current_thread().name
            if step == self.fail_at:
                raise OSError(f"corrupt shard at step {step}")
            return super().rows(kind, step, count)

    plain = Trainer(toy_cfg(tmp_path, "plain", steps=5, prefetch="off"), ToyLM, ToySource()).fit()
    source = Recording()
    ahead = Trainer(toy_cfg(tmp_path, "ahead", steps=5, prefetch="on"), ToyLM, source)
    assert [r["loss"] for r in ahead.fit()] == [r["loss"] for r in plain]
    ahead.close()
    assert sorted(source.threads) == [0, 1, 2, 3, 4]  # each step built once, none past the last
    assert source.threads[0] == "MainThread" and all(source.threads[s].startswith("openm3-rows") for s in (1, 4))
    failing = Trainer(toy_cfg(tmp_path, "fail", steps=5, prefetch="on"), ToyLM, Recording(fail_at=3))
    with pytest.raises(OSError, match="corrupt shard at step 3"):
        failing.fit()
    assert failing.step == 3
    with pytest.raises(ValueError, match="prefetch must be auto|on|off"):
        toy_cfg(tmp_path, prefetch="yes")


class EventTrainer(Trainer):
    """A trainer that records the order of its steps' launches, value reads, evaluations and checkpoints."""

    def __init__(self, *args, **kwargs):
        self.events = []
        super().__init__(*args, **kwargs, evaluator=lambda t, step: t.events.append(("eval", step)) or {})

    def launch_step(self):
        self.events.append(("launch", self.step))
        pending = super().launch_step()
        record = pending.record

        def read():
            if pending._record is None:
                self.events.append(("read", pending.step))
            return record()
        pending.record = read
        return pending

    def save_checkpoint(self, **kwargs):
        self.events.append(("save", self.step))
        return super().save_checkpoint(**kwargs)


def test_overlapped_steps_read_values_one_step_late_and_change_nothing(tmp_path):
    """overlap_steps (the default): fit queues step N+1 before it reads step N's logged values (the one device
    sync of a step), but reads them before any evaluation or checkpoint; the records, the log and the checkpoints
    are those of reading every step first (`overlap_steps=False`), timings aside."""
    runs = {}
    for overlap in (True, False):
        t = EventTrainer(toy_cfg(tmp_path, f"o{overlap}", steps=5, ckpt_every=2, overlap_steps=overlap), ToyLM,
                         ToySource())
        runs[overlap] = (t, t.fit())
    L, R = "launch", "read"
    assert runs[True][0].events == [(L, 0), (L, 1), (R, 0), (R, 1), ("save", 2), (L, 2), (L, 3), (R, 2), (R, 3),
                                    ("save", 4), (L, 4), (R, 4), ("save", 5), ("eval", 5)]
    assert runs[False][0].events == [(L, 0), (R, 0), (L, 1), (R, 1), ("save", 2), (L, 2), (R, 2), (L, 3), (R, 3),
                                     ("save", 4), (L, 4), (R, 4), ("save", 5), ("eval", 5)]
    timing = ("tokens_per_s",)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]  # noqa: E731
    assert strip(runs[True][1]) == strip(runs[False][1])
    assert [r["step"] for r in runs[True][1]] == list(range(5))
    assert all(r["tokens_per_s"] > 0 for r in runs[True][1])
    logs = [strip(r for r in read_jsonl(tmp_path / f"o{o}" / "metrics.jsonl") if "loss" in r) for o in (True, False)]
    assert logs[0] == logs[1] and [r["step"] for r in logs[0]] == list(range(5))
    a, b = (torch.load(latest_checkpoint(tmp_path / f"o{o}" / "checkpoints") / "trainer_state.pt", weights_only=False)
            for o in (True, False))
    assert a["step"] == b["step"] == 5 and a["scheduler"] == b["scheduler"]


class SlowToyLM(ToyLM):
    """A forward that takes at least `SECONDS`, so every step's wall time has a known floor."""

    SECONDS = 0.04

    def forward(self, *args, **kwargs):
        time.sleep(self.SECONDS)
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize("overlap", [True, False])
def test_step_tokens_per_s_times_the_step_itself(tmp_path, overlap):
    """tokens_per_s of every step (the progress bar's and the log's) covers that step's own compute: on the host,
    a step's values exist when it ends, so reading them after the next step ran must not shorten it (the last step
    of an overlapped CPU run had measured ~0 s, i.e. millions of tokens/s)."""
    cfg = toy_cfg(tmp_path, steps=4, micro_batch=4, overlap_steps=overlap)  # one forward per step
    records = Trainer(cfg, SlowToyLM, ToySource()).fit()
    seconds = [r["tokens"] / r["tokens_per_s"] for r in records]
    assert len(seconds) == 4 and min(seconds) >= SlowToyLM.SECONDS, seconds


def test_launched_step_reads_its_values_once(tmp_path):
    t = Trainer(toy_cfg(tmp_path, steps=3), ToyLM, ToySource())
    first = t.launch_step()
    second = t.launch_step()
    assert t.step == 2 and (first.step, second.step) == (0, 1)
    rec = first.record()
    assert first.record() is rec and rec["step"] == 0 and second.record()["step"] == 1
    ref = Trainer(toy_cfg(tmp_path, "ref", steps=3), ToyLM, ToySource())
    assert [ref.train_step()["loss"] for _ in range(2)] == [rec["loss"], second.record()["loss"]]


@pytest.mark.parametrize("overlap,ckpt_every,stopped_at", [(True, 3, 3), (False, 3, 3), (True, 0, 4), (False, 0, 3)])
def test_non_finite_loss_stops_fit_before_a_checkpoint_holds_it(tmp_path, overlap, ckpt_every, stopped_at):
    """A NaN loss at step 2 stops `fit`: one step later when steps overlap (step 3 is queued first), but before
    the checkpoint due after step 2 either way (its values are read first)."""
    class Poisoned(ToySource):
        def rows(self, kind, step, count):
            rows = super().rows(kind, step, count)
            if step == 2:
                model.head.weight.data.fill_(float("nan"))
            return rows

    cfg = toy_cfg(tmp_path, steps=6, ckpt_every=ckpt_every, overlap_steps=overlap, aux_loss_weight=0.0,
                  kl_weight=0.0)
    t = Trainer(cfg, ToyLM, Poisoned())
    model = t.model
    with pytest.raises(FloatingPointError, match="loss is nan at step 2"):
        t.fit()
    assert t.step == stopped_at
    assert latest_checkpoint(tmp_path / "run" / "checkpoints") is None
    assert [r["step"] for r in t.history] == [0, 1]


def test_overlap_steps_cli_flag():
    from openm3.train.cli import build_config, parse_args

    assert build_config(parse_args([])).overlap_steps is True
    assert build_config(parse_args(["--no-overlap-steps"])).overlap_steps is False


def test_resume_restores_rng_and_scheduler(tmp_path):
    cfg = toy_cfg(tmp_path, steps=6)
    t = Trainer(cfg, ToyLM, ToySource())
    t.fit(until=2)
    torch.manual_seed(1234)
    t.save_checkpoint()
    expected = torch.rand(4)
    lr = t.optimizer.param_groups[0]["lr"]
    t2 = Trainer(cfg, ToyLM, ToySource())
    torch.manual_seed(99)
    assert t2.resume()
    assert torch.equal(torch.rand(4), expected)
    assert t2.optimizer.param_groups[0]["lr"] == lr
    assert t2.scheduler.last_epoch == 2
    meta = json.loads((latest_checkpoint(tmp_path / "run" / "checkpoints") / "meta.json").read_text())
    assert meta["step"] == 2


def test_metrics_logger_writes_jsonl_and_tensorboard(tmp_path):
    from openm3.train.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=True)
    logger.log({"step": 0, "loss": 2.0, "msa_stage": "dense"})
    logger.log({"step": 1, "loss": 1.5, "msa_stage": "sparse"})
    logger.truncate_after(1)
    logger.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "loss": 2.0, "msa_stage": "dense"}]
    try:
        import tensorboard  # noqa: F401  (the optional `train` extra)
        assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    except ImportError:
        assert not (tmp_path / "tensorboard").exists()
    off = MetricsLogger(tmp_path / "off", enabled=False)
    off.log({"step": 0, "loss": 1.0})
    assert not (tmp_path / "off").exists()


def test_activation_checkpointing_gives_the_same_updates(tmp_path):
    plain = Trainer(toy_cfg(tmp_path, "plain", steps=3), ToyLM, ToySource()).fit()
    ac = Trainer(toy_cfg(tmp_path, "ac", steps=3, activation_checkpointing=True), ToyLM, ToySource())
    wrapped = [type(m).__name__ for m in ac.model.layers]
    assert wrapped == ["CheckpointWrapper"] * 2
    got = ac.fit()
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in plain], abs=1e-6)


def test_warmup_kl_kept_from_the_backbone(tmp_path):
    """TrainConfig.warmup_kl_to_backbone=False: the dense warm-up's indexer KL trains the index branch only. Its
    first step's losses are the default's; after it the index branch's weights are the default run's (same
    gradients) and the backbone's differ (no KL gradient)."""
    from openm3.models.config import M3TextConfig
    from openm3.models.text import M3TextModel
    from openm3.train.cli import build_config, parse_args
    from test_train_compile import PackedRows, tiny_cfg

    assert build_config(parse_args(["--no-warmup-kl-to-backbone"])).warmup_kl_to_backbone is False
    mcfg = M3TextConfig.from_name("m3-tiny")
    records, weights = {}, {}
    for to_backbone in (True, False):
        cfg = tiny_cfg(tmp_path, f"kl{to_backbone}", steps=2, msa_switch_step=2, warmup_kl_to_backbone=to_backbone,
                       grad_clip=1e9)  # no clipping: its global scale would differ between the runs
        trainer = Trainer(cfg, lambda: M3TextModel(mcfg), PackedRows(mcfg.vocab_size))
        records[to_backbone] = trainer.train_step()
        weights[to_backbone] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.close()
    assert records[True]["loss"] == records[False]["loss"]
    assert records[True]["indexer_kl"] == pytest.approx(records[False]["indexer_kl"], rel=1e-6)
    indexer = [n for n in weights[True] if ".indexer." in n]
    assert indexer
    for name in indexer:
        torch.testing.assert_close(weights[False][name], weights[True][name], rtol=0, atol=1e-7, msg=name)
    assert not torch.allclose(weights[False]["layers.0.self_attn.q_proj.weight"],
                              weights[True]["layers.0.self_attn.q_proj.weight"], rtol=0, atol=1e-6)


# ---- the Python API's guards (a user audit) ------------------------------------------------------------------
def test_a_trainer_with_other_settings_does_not_resume_a_run(tmp_path):
    """`Trainer.resume` compares the trainer's config with the run's (its checkpoint holds it): what the run
    trains may not change (each differing setting named, nothing loaded), how it runs may; the run's
    train_config.json is written by `fit`, so a refused trainer leaves it as it was."""
    cfg = toy_cfg(tmp_path, steps=6)
    Trainer(cfg, ToyLM, ToySource()).fit(until=2)
    TrainConfig.from_json(tmp_path / "run" / "train_config.json")  # written by fit
    saved = (tmp_path / "run" / "train_config.json").read_text()
    first = Trainer(cfg, ToyLM, ToySource())
    first.save_checkpoint()
    changed = Trainer(toy_cfg(tmp_path, steps=6, lr=3e-2, seq_len=16), ToyLM, ToySource())
    with pytest.raises(ValueError, match=r"^resume: .*step_00000000 is a run made with seq_len=24 \(this trainer's "
                                         r"16\), lr=0.01 \(this trainer's 0.03\); a resumed run keeps what it "
                                         r"trains"):
        changed.resume()
    assert changed.step == 0 and (tmp_path / "run" / "train_config.json").read_text() == saved
    longer = Trainer(toy_cfg(tmp_path, steps=9, micro_batch=1, ckpt_every=2), ToyLM, ToySource())
    assert longer.resume() and longer.step == 0 and longer.fit()[-1]["step"] == 8


def test_a_trainer_takes_a_model_builder_not_a_model(tmp_path):
    with pytest.raises(ValueError, match=r"^build_model must be a zero-argument callable returning a fresh model "
                                         r".*got ToyLM"):
        Trainer(toy_cfg(tmp_path), ToyLM(), ToySource())


def test_rows_refuse_labels_equal_to_their_inputs():
    """transformers' habit (labels = input_ids, shifted inside the model) would train 'predict this token'."""
    ids = torch.tensor([5, 6, 7, 8])
    with pytest.raises(ValueError, match="Row.labels equal Row.input_ids at every labelled position"):
        Row(ids, ids.clone(), [4])
    Row(ids, torch.tensor([6, 7, 8, IGNORE]), [4])  # aligned: the next token
    Row(torch.tensor([3, 3, 3]), torch.tensor([3, 3, IGNORE]), [3])  # a repeated token's next token is itself
