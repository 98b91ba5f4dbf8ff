"""`openm3.train.memory`: the training memory estimate. Its parts scale as the run does (weights, gradients and
optimizer state shard over ranks, activations grow with the tokens of a forward and shrink with checkpointing and
bf16); on CPU its activations match what the trainer's forward leaves for the backward and its total the step's
peak, both measured; `openm3 train` prints it and on CUDA refuses a run it says does not fit, naming what to change.
"""

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from openm3.models.config import M3TextConfig
from openm3.models.multimodal import M3ForConditionalGeneration, M3VLConfig
from openm3.models.text import M3TextModel
from openm3.train import cli
from openm3.train.batches import IGNORE, Row, collate, step_rows
from openm3.train.config import TrainConfig
from openm3.train.losses import token_losses
from openm3.train.memory import GIB, check_fits, estimate_training_memory, memory_advice
from openm3.train.trainer import Trainer, model_forward
from test_train_toy import ToyLM, ToySource

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VOCAB = M3TextConfig.from_name("m3-tiny").vocab_size
IMG = VOCAB - 2  # the VL model's image placeholder (and VOCAB - 1 its video one)


def small(**kw) -> TrainConfig:
    base = dict(model="m3-small", recipe="text-only", steps=10, seq_len=4096, text_rows=4, micro_batch=1)
    return TrainConfig(**(base | kw))


M3_SMALL = M3TextConfig.from_name("m3-small")


# ---- how the parts scale ----------------------------------------------------------------------------------------
def test_weights_gradients_and_optimizer_shard_over_ranks():
    one = estimate_training_memory(M3_SMALL, small(), 1, "cuda")
    n = M3_SMALL.num_parameters()
    assert one.parameters == 4 * n and one.gradients == 4 * n and one.optimizer == 8 * n  # fp32 weights, AdamW
    for world in (2, 4):  # one row per rank: one micro-batch, so no unsharded gradient accumulation
        est = estimate_training_memory(M3_SMALL, small(text_rows=world), world, "cuda")
        assert (est.parameters, est.gradients, est.optimizer) == (4 * n // world, 4 * n // world, 8 * n // world)
        # the same tokens per forward on each rank, the same saved tensors (autocast's bf16 or FSDP2's)
        assert one.activations == est.activations
    # FSDP2 with gradient accumulation keeps every parameter's unsharded fp32 gradient between micro-batches
    accumulating = estimate_training_memory(M3_SMALL, small(text_rows=8), 2, "cuda")
    assert accumulating.gradients == 4 * n // 2 + 4 * n


def test_weight_copies_are_the_bf16_matrices_autocast_casts():
    n = M3_SMALL.num_parameters()
    embeddings = M3_SMALL.vocab_size * M3_SMALL.hidden_size
    vectors = sum(p.numel() for p in on_meta(M3_SMALL).parameters() if p.dim() < 2)
    assert estimate_training_memory(M3_SMALL, small(), 1, "cuda").weight_copies == 2 * (n - embeddings - vectors)
    assert estimate_training_memory(M3_SMALL, small(param_dtype="float32"), 1, "cuda").weight_copies == 0
    # checkpointed: only the matrices outside the decoder layers (lm_head) stay cast until the backward
    assert estimate_training_memory(M3_SMALL, small(activation_checkpointing=True), 1, "cuda").weight_copies == \
        2 * embeddings


def on_meta(config):
    """The model of a text or VL config on the meta device (shapes only)."""
    with torch.device("meta"):
        return M3TextModel(config) if isinstance(config, M3TextConfig) else M3ForConditionalGeneration(config)


def test_activations_grow_with_the_tokens_of_a_forward():
    base = estimate_training_memory(M3_SMALL, small(seq_len=2048), 1, "cuda")
    for kw in ({"seq_len": 4096}, {"seq_len": 2048, "micro_batch": 2}):
        double = estimate_training_memory(M3_SMALL, small(**kw), 1, "cuda")
        assert double.tokens == 2 * base.tokens
        assert double.activations == 2 * base.activations
    # the rows of a rank, not micro_batch, bound a forward
    assert estimate_training_memory(M3_SMALL, small(micro_batch=16), 1, "cuda").tokens == 4 * 4096


def test_checkpointing_and_bf16_lower_the_activations():
    plain = estimate_training_memory(M3_SMALL, small(), 1, "cuda")
    ckpt = estimate_training_memory(M3_SMALL, small(activation_checkpointing=True), 1, "cuda")
    keep = estimate_training_memory(M3_SMALL, small(activation_checkpointing=True, ac_keep_attention=True), 1, "cuda")
    no_reuse = estimate_training_memory(M3_SMALL, small(activation_checkpointing=True, ac_reuse_msa=False,
                                                        kl_in_backward=False), 1, "cuda")
    reuse = estimate_training_memory(M3_SMALL, small(activation_checkpointing=True, kl_in_backward=False), 1, "cuda")
    assert ckpt.activations < keep.activations < plain.activations
    assert ckpt.activations < plain.activations / 4
    # reused, the selections and the KL's fp32 gradients stay: the gradients 2.4 GB for m3-small's 15 MSA layers at
    # 64K tokens (docs/usage.md, TrainConfig.ac_reuse_msa), the selections ~0.3 GB more; here 4K tokens
    assert 2.4e9 < (reuse.activations - no_reuse.activations) * 16 < 3.0e9
    fp32 = estimate_training_memory(M3_SMALL, small(param_dtype="float32"), 1, "cuda")
    # bf16 halves most saved tensors; the norms' inputs stay fp32, and fp32 runs the reference experts (more saved)
    assert 0.45 * fp32.activations < plain.activations < 0.6 * fp32.activations
    assert fp32.parameters == plain.parameters


def test_vision_counts_only_when_the_recipe_has_vision_rows():
    vl = M3VLConfig.from_name("m3-small", image_token_index=1, video_token_index=2)
    text = estimate_training_memory(vl, small(), 1, "cuda")
    native = estimate_training_memory(vl, small(recipe="native"), 1, "cuda")
    denser = estimate_training_memory(vl, small(recipe="native"), 1, "cuda", patches_per_token=2.0)
    tower = sum(p.numel() for name, p in on_meta(vl).named_parameters() if not name.startswith("language_model."))
    assert text.vision == 0 and native.vision > 0 and denser.vision == pytest.approx(2 * native.vision, rel=1e-3)
    assert text.parameters == native.parameters  # the tower's weights exist either way
    assert native.gradients - text.gradients == 4 * tower and native.optimizer - text.optimizer == 8 * tower


def test_the_msa_stage_that_needs_more_is_estimated():
    warmup = estimate_training_memory(M3_SMALL, small(msa_switch_step=100, steps=10), 1, "cuda")
    sparse = estimate_training_memory(M3_SMALL, small(), 1, "cuda")
    both = estimate_training_memory(M3_SMALL, small(msa_switch_step=5), 1, "cuda")
    assert (warmup.stage, sparse.stage) == ("dense", "sparse")
    assert both.total == max(warmup.total, sparse.total) and both.stage == max(
        (warmup, sparse), key=lambda e: e.total).stage


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="device must be 'cuda' or 'cpu'"):
        estimate_training_memory(M3_SMALL, small(), 1, "tpu")
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        estimate_training_memory(M3_SMALL, small(), 0)
    with pytest.raises(ValueError, match="holds no openm3 text decoder"):
        estimate_training_memory(torch.nn.Linear(2, 2), small())


# ---- the refusal -------------------------------------------------------------------------------------------------
def test_a_run_over_the_gpu_is_refused_naming_the_estimate_and_what_to_change():
    cfg = small(micro_batch=2)
    est = estimate_training_memory(M3_SMALL, cfg, 1, "cuda")
    with pytest.raises(ValueError) as caught:
        check_fits(est, int(est.total / 1.5), cfg)
    message = str(caught.value)
    assert f"needs about {est.total / GIB:.1f} GiB per GPU" in message
    assert f"the GPU has {est.total / 1.5 / GIB:.1f} GiB" in message
    for flag in ("--micro-batch (now 2", "--activation-checkpointing", "--seq-len (now 4096)", "more GPUs",
                 "--skip-memory-check"):
        assert flag in message
    assert memory_advice(cfg, 1) in message  # the trainer's out-of-memory advice, shared
    assert memory_advice(small(activation_checkpointing=True), 1, gpu=False) == "try a shorter --seq-len (now 4096)"
    assert "near the GPU" in check_fits(est, int(est.total / 1.05), cfg)
    assert check_fits(est, 2 * est.total, cfg) is None
    # compiled steps save less than the eager kernels the estimate models: refused only further over
    over = int(est.total / 1.2)
    with pytest.raises(ValueError, match="needs about"):
        check_fits(est, over, cfg)
    assert "near the GPU" in check_fits(est, over, small(micro_batch=2, compile=True))
    with pytest.raises(ValueError, match="needs about"):
        check_fits(est, int(est.total / 1.3), small(micro_batch=2, compile=True))


@pytest.fixture
def fake_gpu(monkeypatch):
    """`openm3 train --device cuda` on a machine that says it has a GPU of 8 GiB; Trainer never built."""
    from openm3.train import distributed as D

    built = []
    monkeypatch.setattr(D, "pick_device", lambda name: torch.device("cuda" if name != "cpu" else "cpu"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (7 * GIB, 8 * GIB))
    monkeypatch.setattr("openm3.train.trainer.Trainer.__init__", lambda *a, **k: (built.append(1), (
        _ for _ in ()).throw(RuntimeError("built")))[1])
    return built


def test_openm3_train_refuses_before_building_the_model(tmp_path, fake_gpu, capsys):
    argv = ["--model", "m3-small", "--seq-len", "8192", "--text-rows", "8", "--micro-batch", "8", "--device",
            "cuda", "--recipe", "text-only", "--out", str(tmp_path / "run")]
    with pytest.raises(ValueError, match=r"per GPU by the memory estimate .* but the GPU has 8\.0 GiB: try a smaller "
                                         r"--micro-batch \(now 8; .*--activation-checkpointing, a shorter --seq-len "
                                         r"\(now 8192\) or more GPUs .*\(--skip-memory-check runs it anyway\)"):
        cli.main(argv)
    assert fake_gpu == []
    assert capsys.readouterr().out.startswith("memory estimate: ")
    with pytest.raises(RuntimeError, match="built"):
        cli.main(argv + ["--skip-memory-check", "-v"])
    assert fake_gpu == [1]
    printed = capsys.readouterr().out
    assert "GiB per GPU of 8.00 GiB" in printed and "  optimizer" in printed and "decoder layers (saved)" in printed


def test_openm3_train_on_cpu_checks_the_hosts_memory(tmp_path, fake_gpu, capsys, monkeypatch):
    """On a CPU the host's memory and swap are the device: a run far past them is refused (the kernel's
    out-of-memory killer would end it without a word), one they hold goes on."""
    from openm3.train import memory

    argv = ["--model", "m3-small", "--seq-len", "16384", "--micro-batch", "4", "--device", "cpu", "--recipe",
            "text-only", "--out", str(tmp_path / "run")]
    monkeypatch.setattr(memory, "host_memory", lambda: 24 * GIB)
    with pytest.raises(ValueError, match=r"GiB on this host by the memory estimate .* but the host has 24\.0 GiB "
                                         r"of memory and swap: try a smaller --micro-batch .* or a shorter --seq-len "
                                         r"\(now 16384\) \(--skip-memory-check"):
        cli.main(argv)
    assert fake_gpu == [] and "GiB of host memory of 24.00 GiB (" in capsys.readouterr().out
    monkeypatch.setattr(memory, "host_memory", lambda: 1024 * GIB)
    with pytest.raises(RuntimeError, match="built"):
        cli.main(argv)
    assert fake_gpu == [1]
    printed = capsys.readouterr().out
    assert "GiB of host memory of 1024.00 GiB (" in printed and float(printed.split()[2]) > 100
    monkeypatch.setattr(memory, "host_memory", lambda: None)  # unknown (not Linux): printed only
    with pytest.raises(RuntimeError, match="built"):
        cli.main(argv)
    # ranks of one host share its memory
    est = estimate_training_memory(M3_SMALL, small(), 2, "cpu")
    assert check_fits(est, int(1.5 * est.total), small()) is None  # one rank fits
    with pytest.raises(ValueError, match="on this host for its 2 ranks"):
        check_fits(est, int(1.5 * est.total), small(), ranks_here=2)


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "--skip-memory-check" in out and "-v, --verbose" in out


# ---- the estimate against what the trainer holds on CPU ------------------------------------------------------------
class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that aten ops made inside this mode and that are still alive (views of `exclude`'s
    storages are not counted), and the most alive at once. Unlike `saved_tensors_hooks`, which the checkpoints'
    own hooks hide, it sees everything a step holds: saved tensors, checkpoint inputs, the logits."""

    def __init__(self, exclude=()):
        super().__init__()
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.alive: dict[int, tuple[int, weakref.ref]] = {}  # id(storage): (bytes, a weak reference to it)
        self.live = self.peak = 0

    def _freed(self, key):
        def callback(_):
            self.live -= self.alive.pop(key)[0]
        return callback

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)  # storages are preserved Python objects while alive
            if key in self.alive or storage.data_ptr() in self.exclude:
                continue
            self.alive[key] = (storage.nbytes(), weakref.ref(storage, self._freed(key)))
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        return out


class Rows:
    """Random text rows; rows of other kinds begin with `images` images of 8 x 8 patches (16 visual tokens each).
    Text ids below `vocab - 2`, the image placeholder (the VL model's: `vocab - 2`; its video one `vocab - 1`)."""

    def __init__(self, seq_len: int, images: int = 0, vocab: int = VOCAB):
        self.seq_len, self.images, self.image_id = seq_len, images, vocab - 2

    def rows(self, kind, step, count):
        g = torch.Generator().manual_seed(step)
        out = []
        for _ in range(count):
            ids = torch.randint(0, self.image_id, (self.seq_len + 1,), generator=g)
            inputs, labels, vision = ids[:-1].clone(), ids[1:].clone(), {}
            if kind != "text":
                inputs[:16 * self.images], labels[:16 * self.images] = self.image_id, IGNORE
                vision = {"pixel_values": torch.randn(64 * self.images, 1176, generator=g),
                          "image_grid_thw": torch.tensor([[1, 8, 8]] * self.images)}
            out.append(Row(inputs, labels, [self.seq_len], kind=kind, vision=vision))
        return out

    def patches_per_token(self) -> float:
        return 64 * self.images / self.seq_len


def measure(trainer: Trainer, source: Rows) -> tuple[int, int]:
    """(bytes a micro-batch's forward leaves for its backward, the most of the second step) of a CPU trainer: the
    most alive at any micro-batch's backward call less the gradients already accumulated, and the step's peak plus
    the weights and AdamW state made before it. The step's rows are built outside the count (the host's data)."""
    trainer.train_step()  # the optimizer state exists from here on
    rows = step_rows(source, trainer.plan.rows(1), 1)
    trainer._rows = lambda step: rows
    before = [*trainer.model.parameters(), *(t for state in trainer.optimizer.state.values()
                                             for t in state.values() if torch.is_tensor(t))]
    held, backward = [], torch.Tensor.backward
    gc.collect()
    with LiveBytes(exclude=before) as live:
        def snapshot(loss, *args, **kwargs):
            gc.collect()
            held.append(live.live - sum(p.grad.nbytes for p in trainer.model.parameters() if p.grad is not None))
            return backward(loss, *args, **kwargs)

        torch.Tensor.backward = snapshot
        try:
            trainer.train_step()
        finally:
            torch.Tensor.backward = backward
    return max(held), live.peak + sum(t.nbytes for t in before)


CASES = {  # name: (TrainConfig fields, images per vision row)
    "T256": (dict(seq_len=256), 0),
    "T1024": (dict(seq_len=1024), 0),
    "T1024-ckpt": (dict(seq_len=1024, activation_checkpointing=True), 0),
    "T1024-ckpt-keep": (dict(seq_len=1024, activation_checkpointing=True, ac_keep_attention=True), 0),
    "T1024-ckpt-warmup": (dict(seq_len=1024, activation_checkpointing=True, msa_switch_step=10), 0),
    "T1024-warmup-kl-only": (dict(seq_len=1024, msa_switch_step=10, aux_loss_weight=0.0), 0),
    "VL512-img8": (dict(seq_len=512), 8),
    "VL1024-img8-ckpt": (dict(seq_len=1024, activation_checkpointing=True), 8),
    "VL512-img8-ckpt-keep": (dict(seq_len=512, activation_checkpointing=True, ac_keep_attention=True), 8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_estimate_matches_what_a_cpu_step_holds(tmp_path, name):
    """m3-tiny in fp32 on CPU, two micro-batches of two rows per step (the second's forward runs beside the first's
    gradients, as the estimate assumes), the second step measured. Activations within 2% (measured: within 0.3%),
    the peak within 5% (measured: 0.6-1.8% below): the backward's transients (the order it frees tensors in, the
    reference ops' chunk workspaces) are modelled more coarsely than what the forward saves."""
    fields, images = CASES[name]
    vision = images > 0
    cfg = TrainConfig(model="m3-tiny", recipe="native" if vision else "text-only", steps=3,
                      text_rows=2 if vision else 4, micro_batch=2,
                      mixture={"text": 1.0, "image": 1.0, "video": 0.0} if vision else None,
                      out_dir=str(tmp_path / "run"), progress=False, tensorboard=False, device="cpu", **fields)
    build = (lambda: M3ForConditionalGeneration(M3VLConfig.from_name("m3-tiny", IMG, IMG + 1))) if vision else (
        lambda: M3TextModel(M3TextConfig.from_name("m3-tiny")))
    source = Rows(cfg.seq_len, images)
    trainer = Trainer(cfg, build, source)
    try:
        held, peak = measure(trainer, source)
        est = trainer.memory_estimate(patches_per_token=source.patches_per_token())
    finally:
        trainer.close()
    print(f"{name}: activations measured {held / 2**20:.2f} MiB, estimated {(est.activations + est.vision) / 2**20:.2f}"
          f"; peak measured {peak / 2**20:.2f} MiB, estimated {est.allocated / 2**20:.2f}")
    assert held == pytest.approx(est.activations + est.vision, rel=0.02)
    assert peak == pytest.approx(est.allocated, rel=0.05)
    assert est.workspace == 0 and est.weight_copies == 0  # fp32 on CPU: no autocast copies, no CUDA context


def test_the_activations_are_what_autograd_saves(tmp_path):
    """Without checkpointing, the tensors autograd saves (`saved_tensors_hooks`, unique storages, weights excluded)
    plus the logits the step holds are the estimate's activations."""
    cfg = TrainConfig(model="m3-tiny", recipe="text-only", seq_len=512, micro_batch=2, out_dir=str(tmp_path),
                      device="cpu")
    model = M3TextModel(M3TextConfig.from_name("m3-tiny")).train()
    batch = collate(Rows(cfg.seq_len).rows("text", 0, 2))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model_forward(model, batch, msa_stage="sparse")
        loss = token_losses(out.logits, batch.labels).sum() + out.indexer_kl + out.aux_loss
    est = estimate_training_memory(model, cfg, 1, "cpu")
    assert sum(saved.values()) + out.logits.nbytes == pytest.approx(est.activations, rel=0.02)
    assert loss.isfinite()


def test_trainer_memory_estimate_is_the_estimate_of_its_model_and_config(tmp_path):
    cfg = TrainConfig(model="m3-tiny", recipe="text-only", seq_len=64, out_dir=str(tmp_path / "a"), device="cpu",
                      progress=False, tensorboard=False)
    trainer = Trainer(cfg, lambda: M3TextModel(M3TextConfig.from_name("m3-tiny")), Rows(64))
    assert trainer.memory_estimate() == estimate_training_memory(M3TextConfig.from_name("m3-tiny"), cfg, 1, "cpu")
    trainer.close()
    toy = Trainer(TrainConfig(recipe="text-only", seq_len=24, out_dir=str(tmp_path / "b"), progress=False,
                              tensorboard=False), ToyLM, ToySource())
    with pytest.raises(ValueError, match="holds no openm3 text decoder"):
        toy.memory_estimate()
    toy.close()
