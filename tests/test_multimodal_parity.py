"""Processor and full vision-language model: parity with transformers 5.24.0's MiniMax M3 VL.

HF's M3 image/video processors are torchvision-only and torchvision's PyPI wheels do not load beside the
CPU torch build used here. The reference therefore runs in a subprocess with a *stand-in* torchvision
that provides the five functions the M3 processors call (resize, normalize, grayscale_to_rgb, to_dtype,
InterpolationMode), each transcribed from torchvision 0.28's CPU code path: resize of uint8 images is
``F.interpolate(uint8, "bicubic", align_corners=False, antialias=True)``, as torchvision does on CPU.
Everything else on the reference side -- smart_resize, rescale/normalise fusion, patch order, padding of
odd frame counts, chunking into clips, placeholder expansion with timestamps, the processor's
defaults -- is transformers' own code. Because the resize kernel is the same torch call on both sides,
it is also checked against an independent implementation, Pillow's bicubic resize (within 2 grey levels).
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from openm3.models.processor import (IMAGE_TOKEN, VIDEO_TOKEN, VISION_END_TOKEN, VISION_START_TOKEN,
                                     M3ImageProcessor, M3Processor, M3VideoProcessor, VideoMeta, expand_prompt,
                                     image_to_tensor, resize_bicubic, smart_resize)

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

_STANDIN_TORCHVISION = '''
import enum, importlib.machinery, sys, types
import torch
import torch.nn.functional as F

class InterpolationMode(enum.Enum):
    NEAREST = "nearest"; NEAREST_EXACT = "nearest-exact"; BILINEAR = "bilinear"; BICUBIC = "bicubic"
    BOX = "box"; HAMMING = "hamming"; LANCZOS = "lanczos"

def resize(image, size, interpolation=InterpolationMode.BILINEAR, antialias=True, **_):
    # torchvision 0.28 resize_image, CPU: uint8 and float go to torch as they are, other dtypes via fp32.
    if interpolation not in (InterpolationMode.BICUBIC, InterpolationMode.BILINEAR):
        raise NotImplementedError(interpolation)
    shape = image.shape
    if tuple(shape[-2:]) == tuple(size):
        return image
    x = image.reshape(-1, *shape[-3:])
    cast = image.dtype not in (torch.float32, torch.float64, torch.uint8)
    x = F.interpolate(x.float() if cast else x, size=list(size), mode=interpolation.value,
                      align_corners=False, antialias=antialias)
    if cast:
        x = x.clamp_(0, 255).round_().to(image.dtype)
    return x.reshape(*shape[:-2], *x.shape[-2:])

def normalize(image, mean, std, inplace=False):
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)

def grayscale_to_rgb(image):
    return image if image.shape[-3] >= 3 else image.expand(*image.shape[:-3], 3, *image.shape[-2:])

def to_dtype(image, dtype=torch.float32, scale=False):
    if image.dtype == dtype or not scale:
        return image.to(dtype)
    if image.is_floating_point():
        return image.mul(255 + 1.0 - 1e-3).to(dtype)
    return image.to(dtype).mul_(1.0 / 255)

def _unused(*args, **kwargs):
    raise NotImplementedError("not used by the M3 processors")

_names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
          "torchvision.transforms.v2", "torchvision.transforms.v2.functional", "torchvision.io")
_mods = {}
for _n in _names:
    _m = types.ModuleType(_n)
    _m.__spec__ = importlib.machinery.ModuleSpec(_n, None)
    _m.__file__ = "<stand-in>"
    _mods[_n] = _m
_mods["torchvision"].__version__ = "0.28.0"
_mods["torchvision.transforms"].InterpolationMode = InterpolationMode
_mods["torchvision.transforms.functional"].pil_to_tensor = _unused
_f = _mods["torchvision.transforms.v2.functional"]
for _k, _v in dict(InterpolationMode=InterpolationMode, resize=resize, normalize=normalize,
                   grayscale_to_rgb=grayscale_to_rgb, to_dtype=to_dtype, pad=_unused, crop=_unused).items():
    setattr(_f, _k, _v)
_mods["torchvision"].transforms = _mods["torchvision.transforms"]
_mods["torchvision"].io = _mods["torchvision.io"]
_mods["torchvision.transforms"].v2 = _mods["torchvision.transforms.v2"]
_mods["torchvision.transforms"].functional = _mods["torchvision.transforms.functional"]
_mods["torchvision.transforms.v2"].functional = _f
sys.modules.update(_mods)
'''

_HF_RUN = '''
import json, sys
import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor

case_dir = sys.argv[1]
data = dict(np.load(case_dir + "/inputs.npz"))
spec = json.load(open(case_dir + "/spec.json"))
images = [data[k] for k in spec["images"]]
images[spec["pil_index"]] = Image.fromarray(images[spec["pil_index"]], mode="RGBA")
out = {}
ip = MiniMaxM3VLImageProcessor()
r = ip(images, return_tensors="pt")
out["image_pixels"], out["image_grid"] = r["pixel_values"], r["image_grid_thw"]
vp = MiniMaxM3VLVideoProcessor()
for name, segment in (("4", 4), ("2", 2), ("none", None)):
    r = vp([data["video_odd"]], vision_segment_max_frames=segment, return_tensors="pt")
    out["video_pixels_" + name] = r["pixel_values_videos"]
    out["video_grid_" + name] = r["video_grid_thw"]
    out["video_chunks_" + name] = torch.tensor(r["num_chunks_per_video"])
tok = PreTrainedTokenizerFast(tokenizer_file=case_dir + "/tokenizer.json")
proc = MiniMaxM3VLProcessor(image_processor=ip, tokenizer=tok, video_processor=MiniMaxM3VLVideoProcessor())
r = proc(text=spec["text"], images=[images[i] for i in spec["prompt_images"]],
         videos=[data[k] for k in spec["prompt_videos"]], video_metadata=spec["video_metadata"], return_tensors="pt")
out["prompt_ids"] = r["input_ids"][0]
out["prompt_image_pixels"], out["prompt_image_grid"] = r["pixel_values"], r["image_grid_thw"]
out["prompt_video_pixels"], out["prompt_video_grid"] = r["pixel_values_videos"], r["video_grid_thw"]
torch.save(out, case_dir + "/hf.pt")
'''


def _byte_tokenizer():
    """A lossless byte-level tokenizer that knows the four vision markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([IMAGE_TOKEN, VIDEO_TOKEN, VISION_START_TOKEN, VISION_END_TOKEN])
    return tok


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    """Inputs (saved for the subprocess) and the reference outputs of transformers' processors."""
    case = tmp_path_factory.mktemp("m3proc")
    rng = np.random.default_rng(0)
    inputs = {
        "img_rgb": rng.integers(0, 256, (50, 70, 3), dtype=np.uint8),      # upscaled to the minimum area
        "img_rgba": rng.integers(0, 256, (30, 45, 4), dtype=np.uint8),     # composited on white
        "img_gray": rng.integers(0, 256, (97, 131, 1), dtype=np.uint8),    # grey -> RGB
        "img_pil": rng.integers(0, 256, (40, 60, 4), dtype=np.uint8),      # passed as a PIL RGBA image
        "img_big": rng.integers(0, 256, (700, 840, 3), dtype=np.uint8),    # downscaled below max_pixels
        "video_odd": rng.integers(0, 256, (13, 40, 62, 3), dtype=np.uint8),  # odd frames, resized, 7 steps
        "video_8f": rng.integers(0, 256, (8, 56, 84, 3), dtype=np.uint8),    # 8 frames: one clip of 4
        "video_12f": rng.integers(0, 256, (12, 28, 56, 3), dtype=np.uint8),  # 12 frames: clips of 4 + 2
    }
    spec = {
        "images": ["img_rgb", "img_rgba", "img_gray", "img_pil", "img_big"], "pil_index": 3,
        "text": f"Look {IMAGE_TOKEN} then {VIDEO_TOKEN} and {IMAGE_TOKEN}, finally {VIDEO_TOKEN}.",
        "prompt_images": [0, 3], "prompt_videos": ["video_8f", "video_12f"],
        "video_metadata": [{"total_num_frames": 16, "fps": 4.0, "frames_indices": list(range(0, 16, 2))},
                           {"total_num_frames": 12, "fps": None, "frames_indices": list(range(12))}],
    }
    np.savez(case / "inputs.npz", **inputs)
    (case / "spec.json").write_text(json.dumps(spec))
    _byte_tokenizer().save(str(case / "tokenizer.json"))
    script = _STANDIN_TORCHVISION + textwrap.dedent(_HF_RUN)
    run = subprocess.run([sys.executable, "-c", script, str(case)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return inputs, spec, torch.load(case / "hf.pt")


def _my_images(inputs, spec):
    from PIL import Image
    images = [inputs[k] for k in spec["images"]]
    images[spec["pil_index"]] = Image.fromarray(images[spec["pil_index"]], mode="RGBA")
    return images


def test_image_processor_matches_transformers(hf_reference):
    inputs, spec, ref = hf_reference
    pixels, grid = M3ImageProcessor()(_my_images(inputs, spec))
    assert torch.equal(grid, ref["image_grid"])
    assert pixels.shape == ref["image_pixels"].shape
    assert (pixels - ref["image_pixels"]).abs().max().item() < 1e-5


@pytest.mark.parametrize("frames_per_clip", [4, 2, None], ids=["clip4-F13-H40-W62", "clip2-F13-H40-W62",
                                                                 "whole-F13-H40-W62"])
def test_video_processor_matches_transformers(hf_reference, frames_per_clip):
    inputs, _, ref = hf_reference
    name = "none" if frames_per_clip is None else str(frames_per_clip)
    pixels, clips, counts = M3VideoProcessor(frames_per_clip=frames_per_clip)([inputs["video_odd"]])
    assert torch.equal(clips, ref["video_grid_" + name])
    assert counts == ref["video_chunks_" + name].tolist()
    assert (pixels - ref["video_pixels_" + name]).abs().max().item() < 1e-5


def test_prompt_expansion_matches_transformers(hf_reference):
    inputs, spec, ref = hf_reference
    tok = _byte_tokenizer()
    images = _my_images(inputs, spec)
    meta = [VideoMeta(m["fps"], m["frames_indices"]) for m in spec["video_metadata"]]
    processor = M3Processor(encode=lambda s: tok.encode(s).ids)
    prompt, ids, batch = processor(spec["text"], images=[images[i] for i in spec["prompt_images"]],
                                   videos=[inputs[k] for k in spec["prompt_videos"]], video_metadata=meta)
    assert ids == ref["prompt_ids"].tolist()
    assert torch.equal(batch.image_grid_thw, ref["prompt_image_grid"])
    assert torch.equal(batch.video_grid_thw, ref["prompt_video_grid"])
    assert (batch.pixel_values - ref["prompt_image_pixels"]).abs().max().item() < 1e-5
    assert (batch.pixel_values_videos - ref["prompt_video_pixels"]).abs().max().item() < 1e-5
    # Spelled out: 8 frames at 4 fps sampled every 2nd frame -> 4 steps at 0.0, 1.0, 2.0, 3.0 seconds.
    assert batch.video_grid_thw.tolist() == [[4, 4, 6], [4, 2, 4], [2, 2, 4]]
    assert batch.num_chunks_per_video == [1, 2]
    video_8f = "".join(f"]<]{s:.1f} seconds[>[" + VISION_START_TOKEN + VIDEO_TOKEN * 6 + VISION_END_TOKEN
                       for s in (0.0, 1.0, 2.0, 3.0))
    assert video_8f in prompt
    assert (VISION_START_TOKEN + VIDEO_TOKEN * 2 + VISION_END_TOKEN) * 6 in prompt
    image_tokens = int(batch.image_grid_thw.prod(-1).sum()) // 4
    assert prompt.count(IMAGE_TOKEN) == image_tokens
    assert prompt.count(VIDEO_TOKEN) == int(batch.video_grid_thw.prod(-1).sum()) // 4
    assert prompt.count(VISION_START_TOKEN) == prompt.count(VISION_END_TOKEN) == 2 + 4 + 6


def test_resize_agrees_with_pillow_bicubic():
    from PIL import Image
    rng = np.random.default_rng(1)
    for (h, w), (th, tw) in [((50, 70), (56, 84)), ((300, 200), (168, 112)), ((97, 131), (196, 252))]:
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        pil = np.asarray(Image.fromarray(a).resize((tw, th), Image.BICUBIC)).astype(int)
        ours = resize_bicubic(torch.from_numpy(a).permute(2, 0, 1)[None].contiguous(), th, tw)
        diff = np.abs(ours[0].permute(1, 2, 0).numpy().astype(int) - pil)
        assert diff.max() <= 2 and (diff > 0).mean() < 0.02


def test_smart_resize_rule():
    assert smart_resize(50, 70) == (56, 56)
    assert smart_resize(1000, 1000) == (672, 672)        # 451584 = 672 * 672 is the pixel budget
    assert smart_resize(28, 5000, max_pixels=10**6) == (28, 5012)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500)


def test_bad_images_and_counts_fail_clearly():
    proc = M3ImageProcessor()
    with pytest.raises(ValueError, match="C in"):
        proc(np.zeros((32, 32, 2), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        proc(np.zeros((32, 32, 3), np.float32))
    with pytest.raises(ValueError, match="too small"):
        proc(np.zeros((0, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="too small: 10x40, expected each side >= 14"):
        M3ImageProcessor(min_side=14)(np.zeros((10, 40, 3), np.uint8))
    with pytest.raises(ValueError, match="aspect ratio"):
        proc(np.zeros((1, 300, 3), np.uint8))
    with pytest.raises(ValueError, match="multiples of 28"):
        M3Processor()(VIDEO_TOKEN, videos=[np.zeros((4, 30, 56, 3), np.uint8)])
    with pytest.raises(ValueError, match="F, H, W, C"):
        M3VideoProcessor()([np.zeros((30, 56, 3), np.uint8)])
    grid = torch.tensor([[1, 2, 2]])
    with pytest.raises(ValueError, match="2 .*image.* markers but 1 images"):
        expand_prompt(IMAGE_TOKEN * 2, image_grid_thw=grid)
    with pytest.raises(ValueError, match="markers but 1 videos"):
        expand_prompt("no video here", video_grid_thw=grid, num_chunks_per_video=[1])
    assert image_to_tensor(np.zeros((5, 7), np.uint8)).shape == (3, 5, 7)


# ================================================================================== the full VL model
IMAGE_ID, VIDEO_ID, START_ID, END_ID = 90, 91, 92, 93  # inside the tiny vocabulary of 97
TINY_VISION = dict(hidden_size=28, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2)  # head_dim 14


def _build_hf_vl(seed: int = 0):
    """A tiny random transformers M3 VL model (MSA + MoE text, 2-layer vision tower), weights perturbed."""
    from hf_utils import perturb_, tiny_text_config
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig
    torch.manual_seed(seed)
    config = MiniMaxM3VLConfig(text_config=tiny_text_config(), vision_config=dict(TINY_VISION),
                               projector_hidden_size=40, image_token_index=IMAGE_ID, video_token_index=VIDEO_ID)
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    model = MiniMaxM3SparseForConditionalGeneration(config).eval()
    perturb_(model, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                base = 1.0 if ("norm" in name and name.endswith("weight")) else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    return model


def _prompt(n_image_tokens: int, video_clips: torch.Tensor) -> torch.Tensor:
    """Token ids: text, one image run, one video run per temporal patch (as the processor lays them out), text."""
    ids = [5, 6, START_ID] + [IMAGE_ID] * n_image_tokens + [END_ID, 7, 8]
    per_frame = int(video_clips[0, 1] * video_clips[0, 2]) // 4
    for _ in range(int(video_clips[:, 0].sum())):
        ids += [START_ID] + [VIDEO_ID] * per_frame + [END_ID]
    return torch.tensor(ids + [9, 10, 11, 12, 13] * 5)


@pytest.fixture(scope="module")
def vl_case(tmp_path_factory):
    """HF model, inputs (one image, one 8-frame video, real processor output), reference logits, and the
    model saved in both layouts."""
    from safetensors.torch import save_file
    hf = _build_hf_vl()
    rng = np.random.default_rng(3)
    pixels, image_grid = M3ImageProcessor()([rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)])
    video, video_grid, _ = M3VideoProcessor()([rng.integers(0, 256, (8, 56, 56, 3), dtype=np.uint8)])
    ids = _prompt(int(image_grid.prod(-1).sum()) // 4, video_grid)
    inputs = dict(pixel_values=pixels, image_grid_thw=image_grid, pixel_values_videos=video,
                  video_grid_thw=video_grid)
    with torch.no_grad():
        ref = hf(input_ids=ids[None], **inputs).logits[0]
    published = tmp_path_factory.mktemp("published")
    hf.save_pretrained(str(published), max_shard_size="200KB")  # transformers writes MiniMax's layout
    native = tmp_path_factory.mktemp("transformers_layout")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(native / "model.safetensors"))
    (native / "config.json").write_text(json.dumps(hf.config.to_dict()))
    return dict(hf=hf, ids=ids, inputs=inputs, ref=ref, dirs={"published": published, "transformers": native})


@pytest.mark.parametrize("layout", ["published", "transformers"])
def test_vl_logits_match_transformers(vl_case, layout):
    from openm3.models.multimodal import M3ForConditionalGeneration
    names = json.loads((vl_case["dirs"]["published"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.startswith("vision_tower.vision_model.encoder.layers.") for n in names)
    assert any(n.startswith("patch_merge_mlp.linear_1.") for n in names)
    model = M3ForConditionalGeneration.from_pretrained(vl_case["dirs"][layout])
    assert vl_case["ids"].shape[0] == 3 + 6 + 3 + 4 * 6 + 25  # 6 image tokens, 4 frames x 4 video tokens
    with torch.no_grad():
        out = model(vl_case["ids"], **vl_case["inputs"]).logits
    ref = vl_case["ref"]
    assert ref.std() > 0.1
    assert (out - ref).abs().max().item() < 1e-4


def test_vl_save_pretrained_is_read_by_transformers(vl_case, tmp_path):
    from transformers import MiniMaxM3SparseForConditionalGeneration
    from openm3.models.multimodal import M3ForConditionalGeneration
    model = M3ForConditionalGeneration.from_pretrained(vl_case["dirs"]["published"])
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    names = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"])
    reference_names = set(json.loads((vl_case["dirs"]["published"] / "model.safetensors.index.json")
                                     .read_text())["weight_map"])
    assert names == reference_names
    hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    again = M3ForConditionalGeneration.from_pretrained(tmp_path)
    with torch.no_grad():
        hf_logits = hf(input_ids=vl_case["ids"][None], **vl_case["inputs"]).logits[0]
        ours = again(vl_case["ids"], **vl_case["inputs"]).logits
    assert (hf_logits - vl_case["ref"]).abs().max().item() < 1e-5
    assert (ours - vl_case["ref"]).abs().max().item() < 1e-4


def test_vl_frames_per_clip_matches_transformers_chunking(vl_case):
    from openm3.models.multimodal import M3ForConditionalGeneration
    from openm3.models.vision import split_clips
    model = M3ForConditionalGeneration.from_pretrained(vl_case["dirs"]["published"])
    inputs = dict(vl_case["inputs"])
    with torch.no_grad():
        ours = model(vl_case["ids"], **inputs, frames_per_clip=2).logits
        inputs["video_grid_thw"], _ = split_clips(inputs["video_grid_thw"], 2)  # HF processor, segments of 2
        ref = vl_case["hf"](input_ids=vl_case["ids"][None], **inputs).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
    assert (ours - vl_case["ref"]).abs().max().item() > 1e-3  # clips of 2 really differ from one clip of 4


def test_vl_placeholder_mismatch_is_a_clear_error(vl_case):
    from openm3.models.multimodal import M3ForConditionalGeneration
    model = M3ForConditionalGeneration.from_pretrained(vl_case["dirs"]["published"])
    ids = vl_case["ids"].clone()
    ids[ids == IMAGE_ID] = 5
    ids[3] = IMAGE_ID  # one image placeholder left for 6 visual tokens
    with pytest.raises(ValueError, match="1 image placeholder tokens but the images give 6"):
        model(ids, **vl_case["inputs"])
    with pytest.raises(ValueError, match="video placeholder tokens but no pixel_values_videos"):
        model(vl_case["ids"], pixel_values=vl_case["inputs"]["pixel_values"],
              image_grid_thw=vl_case["inputs"]["image_grid_thw"])
    with pytest.raises(ValueError, match="image_grid_thw"):
        model(vl_case["ids"], pixel_values=vl_case["inputs"]["pixel_values"])


def test_vl_placeholders_checked_on_the_host(vl_case):
    """`check_visual_placeholders` (what the trainer runs on host tensors) raises what `embed` raises; inside
    `input_ids_checked_by_caller` the model skips its own count reads and gives the same logits."""
    from openm3.models.multimodal import M3ForConditionalGeneration
    from openm3.models.text import input_ids_checked_by_caller
    model = M3ForConditionalGeneration.from_pretrained(vl_case["dirs"]["published"])
    grids = dict(image_grid_thw=vl_case["inputs"]["image_grid_thw"], video_grid_thw=vl_case["inputs"]["video_grid_thw"])
    model.check_visual_placeholders(vl_case["ids"], **grids)  # the real prompt passes
    ids = vl_case["ids"].clone()
    ids[ids == IMAGE_ID] = 5
    ids[3] = IMAGE_ID
    with pytest.raises(ValueError, match="1 image placeholder tokens but the images give 6"):
        model.check_visual_placeholders(ids, **grids)
    with pytest.raises(ValueError, match="video placeholder tokens but no pixel_values_videos"):
        model.check_visual_placeholders(vl_case["ids"], image_grid_thw=grids["image_grid_thw"])
    model.check_visual_placeholders(torch.tensor([5, 6, 7]))  # text only
    with torch.no_grad():
        want = model(vl_case["ids"], **vl_case["inputs"]).logits
        with input_ids_checked_by_caller(model):
            got = model(vl_case["ids"], **vl_case["inputs"]).logits
    assert torch.equal(got, want)


def test_vl_config_reads_transformers_config(vl_case):
    from transformers import MiniMaxM3VLConfig
    from openm3.models.multimodal import M3VLConfig
    d = vl_case["hf"].config.to_dict()
    config = M3VLConfig.from_dict(d)
    assert (config.image_token_index, config.video_token_index, config.projector_hidden_size) == (90, 91, 40)
    assert config.vision_config.hidden_size == 28 and config.text_config.hidden_size == 32
    assert M3VLConfig.from_dict(config.to_dict()) == config
    assert MiniMaxM3VLConfig(**config.to_dict()).image_token_id == 90
    with pytest.raises(ValueError, match="image_token_index"):
        M3VLConfig.from_dict({**d, "image_token_index": 10**6})
    with pytest.raises(ValueError, match="vision_config"):
        M3VLConfig.from_dict({"text_config": d["text_config"]})


def test_vl_preset_trains_vision_from_step_zero():
    """The tiny preset runs a packed batch of two prompts (image in one, 8-frame video in the other) and
    the loss reaches every vision and projector weight."""
    from openm3.models.multimodal import M3ForConditionalGeneration, M3VLConfig
    with pytest.raises(ValueError, match="image_token_index"):
        M3VLConfig.from_name("m3-tiny")
    torch.manual_seed(0)
    config = M3VLConfig.from_name("m3-tiny", image_token_index=1, video_token_index=2)
    model = M3ForConditionalGeneration(config)
    rng = np.random.default_rng(4)
    pixels, image_grid = M3ImageProcessor()([rng.integers(0, 256, (28, 56, 3), dtype=np.uint8)])
    video, video_grid, _ = M3VideoProcessor(do_resize=False)([rng.integers(0, 256, (8, 28, 28, 3), dtype=np.uint8)])
    assert image_grid.tolist() == [[1, 4, 6]] and video_grid.tolist() == [[4, 2, 2]]  # 28x56 is upscaled
    first = torch.tensor([10, 11] + [1] * 6 + [12] * 4)      # 6 image tokens
    second = torch.tensor([13] + [2] * 4 + [14] * 7)         # 4 video tokens
    ids = torch.cat([first, second])
    out = model(ids, pixels, image_grid, video, video_grid, cu_seqlens=torch.tensor([0, 12, 24], dtype=torch.int32))
    assert out.logits.shape == (24, config.text_config.vocab_size)
    loss = torch.nn.functional.cross_entropy(out.logits[:-1], ids[1:])
    loss.backward()
    for name, p in list(model.vision_tower.named_parameters()) + list(model.multi_modal_projector.named_parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
