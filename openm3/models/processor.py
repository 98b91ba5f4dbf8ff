"""Images and videos -> packed patches, ``grid_thw`` and placeholder-expanded prompts, as M3 does it.

Follows ``transformers==5.24.0``'s ``MiniMaxM3VL{Image,Video}Processor`` and ``MiniMaxM3VLProcessor``:

* resize: ``smart_resize`` picks the size (multiples of ``patch * merge`` = 28, pixel count clamped to
  ``[min_pixels, max_pixels]``, aspect kept), then antialiased bicubic interpolation of the uint8 image
  (the kernel torchvision dispatches to on CPU: ``F.interpolate(uint8, "bicubic", antialias=True)``);
* normalise: ``(x - 255 * mean) / (255 * std)`` with OpenAI CLIP mean/std (HF fuses rescale into it);
* patch order: block-major over ``2 x 2`` merge blocks, so 4 consecutive patches form one text token;
  an image is repeated over the temporal patch (2 frames), a video is padded to an even frame count by
  repeating its last frame;
* video chunks: a video's grid is split into clips of ``frames_per_clip`` temporal patches (HF's
  ``vision_segment_max_frames``, default 4 = 8 input frames); each clip is one ``video_grid_thw`` row;
* prompt: each image marker becomes ``START + IMAGE * n + END``; each video marker becomes, per temporal
  patch, an optional ``]<]{seconds:.1f} seconds[>[`` timestamp then ``START + VIDEO * (h*w/4) + END``.

Images are PIL images or numpy ``[H, W]`` / ``[H, W, C]`` uint8 arrays (C in 1, 3, 4); videos are numpy
``[F, H, W, C]`` uint8 arrays. Inside the full processor videos are *not* resized (HF's
``MiniMaxM3VLProcessor.videos_kwargs`` sets ``do_resize=False``), so their frames must already be
multiples of 28 pixels on each side.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from openm3.models.vision import DEFAULT_FRAMES_PER_CLIP, check_frames_per_clip

IMAGE_TOKEN = "]<]image[>["
VIDEO_TOKEN = "]<]video[>["
VISION_START_TOKEN = "]<]start of image[>["
VISION_END_TOKEN = "]<]end of image[>["
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_MIN_PIXELS = 4 * 28 * 28
IMAGE_MAX_PIXELS = 451584
VIDEO_MIN_PIXELS = 4 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
MAX_ASPECT_RATIO = 200


def timestamp_token(seconds: float) -> str:
    """The text marker M3 puts before a video frame taken at ``seconds``."""
    return f"]<]{seconds:.1f} seconds[>["


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = IMAGE_MIN_PIXELS,
                 max_pixels: int = IMAGE_MAX_PIXELS) -> tuple[int, int]:
    """Target ``(height, width)``: multiples of ``factor``, area within ``[min_pixels, max_pixels]``,
    aspect ratio kept as closely as possible. Aspect ratios above 200 are rejected (as in M3)."""
    if height < 1 or width < 1:
        raise ValueError(f"image: too small: expected height and width >= 1, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image: aspect ratio must be at most {MAX_ASPECT_RATIO}, got {height}x{width}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _rgb_from_array(array: np.ndarray, what: str) -> torch.Tensor:
    """``[H, W]`` or ``[..., H, W, C]`` uint8 (C in 1, 3, 4) -> ``uint8 [..., 3, H, W]``.

    Grey is repeated to 3 channels; RGBA is composited onto white as HF does (via float in [0, 1])."""
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8:
        raise ValueError(f"{what}: expected a uint8 numpy array or a PIL image, got "
                         f"{getattr(array, 'dtype', type(array).__name__)}")
    if array.ndim == 2 and what == "image":
        array = array[..., None]
    expected_ndim = 3 if what == "image" else 4
    if array.ndim != expected_ndim or array.shape[-1] not in (1, 3, 4):
        layout = "[H, W, C]" if what == "image" else "[F, H, W, C]"
        raise ValueError(f"{what}: expected {layout} with C in (1, 3, 4), got shape {array.shape}")
    if min(array.shape[:-1]) < 1:
        raise ValueError(f"{what}: too small: expected a non-empty array, got shape {array.shape}")
    x = torch.from_numpy(np.array(array)).movedim(-1, -3)  # a copy: PIL arrays are read-only
    if x.shape[-3] == 1:
        x = x.expand(*x.shape[:-3], 3, *x.shape[-2:])
    elif x.shape[-3] == 4:
        rgba = x.movedim(-3, -1).float().mul_(1.0 / 255)
        rgb = rgba[..., :3] * rgba[..., 3:] + (1 - rgba[..., 3:])
        x = rgb.mul(255 + 1.0 - 1e-3).to(torch.uint8).movedim(-1, -3)
    return x.contiguous()


def image_to_tensor(image) -> torch.Tensor:
    """A PIL image or a numpy uint8 image -> ``uint8 [3, H, W]`` RGB."""
    if hasattr(image, "getbands") and hasattr(image, "convert"):  # PIL.Image.Image, without importing PIL
        from PIL import Image

        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        else:
            image = image.convert("RGB")
        image = np.asarray(image)
    return _rgb_from_array(image, "image")


def resize_bicubic(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Antialiased bicubic resize of ``uint8 [B, C, H, W]`` to ``[B, C, height, width]`` (uint8).

    On CPU, torch resizes uint8 natively (what torchvision does); elsewhere it goes through fp32 and is
    clamped and rounded back, as torchvision does there."""
    if images.shape[-2:] == (height, width):
        return images
    if images.device.type == "cpu":
        return F.interpolate(images, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    out = F.interpolate(images.float(), size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return out.clamp_(0, 255).round_().to(torch.uint8)


def normalize(images: torch.Tensor, mean=CLIP_MEAN, std=CLIP_STD, rescale: float = 1 / 255) -> torch.Tensor:
    """``uint8 [..., C, H, W]`` -> fp32 ``(x - mean / rescale) / (std / rescale)`` (HF's fused form)."""
    m = (torch.tensor(mean, dtype=torch.float32) * (1.0 / rescale)).to(images.device).view(-1, 1, 1)
    s = (torch.tensor(std, dtype=torch.float32) * (1.0 / rescale)).to(images.device).view(-1, 1, 1)
    return (images.to(torch.float32) - m) / s


def patchify(frames: torch.Tensor, patch_size: int = 14, merge_size: int = 2,
             temporal_patch_size: int = 2) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``float [F, C, H, W]`` (F a multiple of ``temporal_patch_size``) -> ``([t*h*w, C*tp*p*p], (t, h, w))``.

    Patch order: frame pair, merge-block row, merge-block column, row and column inside the block;
    each patch vector is laid out (channel, frame, y, x), matching the Conv3d weight."""
    f, c, height, width = frames.shape
    p, m, tp = patch_size, merge_size, temporal_patch_size
    if f % tp or height % (p * m) or width % (p * m):
        raise ValueError(f"frames: expected F % {tp} == 0 and H, W multiples of {p * m}, got {tuple(frames.shape)}")
    t, h, w = f // tp, height // p, width // p
    x = frames.reshape(t, tp, c, h // m, m, p, w // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, c * tp * p * p), (t, h, w)


@dataclass
class VideoMeta:
    """What M3 needs to time-stamp a video: source fps and the source index of each sampled frame."""

    fps: float | None = None
    frames_indices: Sequence[int] | None = None


@dataclass
class VisionBatch:
    """Packed patches of all images (``pixel_values``) and all video clips (``pixel_values_videos``).

    ``pixel_values: float [N, C*2*14*14]``, ``image_grid_thw: long [I, 3]``; ``pixel_values_videos:
    float [M, C*2*14*14]``, ``video_grid_thw: long [K, 3]`` (one row per clip) and
    ``num_chunks_per_video`` (clips of each video, in order)."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    num_chunks_per_video: list[int] | None = None
    video_metadata: list[VideoMeta | None] | None = None

    def model_inputs(self) -> dict[str, torch.Tensor | None]:
        """The keyword arguments of ``M3ForConditionalGeneration.forward`` (``model(ids, **batch.model_inputs())``):
        the pixels and grids. ``num_chunks_per_video`` and ``video_metadata`` only shape the prompt's text."""
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw,
                "pixel_values_videos": self.pixel_values_videos, "video_grid_thw": self.video_grid_thw}


class M3ImageProcessor:
    """Images -> ``(pixel_values [N, 1176], image_grid_thw [I, 3])``; every image has ``t = 1``.

    ``min_side``: images with a side shorter than this are rejected as too small. M3 itself upscales
    anything non-empty (default 1); data pipelines may want a stricter floor."""

    def __init__(self, min_pixels: int = IMAGE_MIN_PIXELS, max_pixels: int = IMAGE_MAX_PIXELS,
                 patch_size: int = 14, temporal_patch_size: int = 2, merge_size: int = 2,
                 do_resize: bool = True, mean=CLIP_MEAN, std=CLIP_STD, min_side: int = 1):
        if min_pixels > max_pixels:
            raise ValueError(f"min_pixels: expected <= max_pixels {max_pixels}, got {min_pixels}")
        if not isinstance(min_side, int) or min_side < 1:
            raise ValueError(f"min_side: expected a positive int, got {min_side!r}")
        self.min_side = min_side
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.do_resize, self.mean, self.std = do_resize, mean, std

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def __call__(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if not images:
            raise ValueError("images: expected at least one image")
        patches, grids = [], []
        for image in images:
            x = image_to_tensor(image)
            if min(x.shape[-2:]) < self.min_side:
                raise ValueError(f"image: too small: {x.shape[-2]}x{x.shape[-1]}, expected each side >= "
                                 f"{self.min_side}")
            if self.do_resize:
                x = resize_bicubic(x[None], *self.target_size(*x.shape[-2:]))[0]
            x = normalize(x, self.mean, self.std)
            frames = x[None].expand(self.temporal_patch_size, *x.shape)
            flat, grid = patchify(frames, self.patch_size, self.merge_size, self.temporal_patch_size)
            patches.append(flat)
            grids.append(grid)
        return torch.cat(patches), torch.tensor(grids, dtype=torch.long)


class M3VideoProcessor:
    """Videos ``[F, H, W, C]`` uint8 -> ``(pixel_values_videos, video_grid_thw per clip, clips per video)``."""

    def __init__(self, min_pixels: int = VIDEO_MIN_PIXELS, max_pixels: int = VIDEO_MAX_PIXELS,
                 patch_size: int = 14, temporal_patch_size: int = 2, merge_size: int = 2,
                 frames_per_clip: int | None = DEFAULT_FRAMES_PER_CLIP, do_resize: bool = True,
                 mean=CLIP_MEAN, std=CLIP_STD):
        check_frames_per_clip(frames_per_clip)
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.frames_per_clip, self.do_resize, self.mean, self.std = frames_per_clip, do_resize, mean, std

    def __call__(self, videos) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        videos = list(videos) if isinstance(videos, (list, tuple)) else [videos]
        if not videos:
            raise ValueError("videos: expected at least one video")
        factor = self.patch_size * self.merge_size
        patches, clips, counts = [], [], []
        for video in videos:
            x = _rgb_from_array(video, "video")  # [F, 3, H, W]
            height, width = x.shape[-2:]
            if self.do_resize:
                x = resize_bicubic(x, *smart_resize(height, width, factor, self.min_pixels, self.max_pixels))
            elif height % factor or width % factor:
                raise ValueError(f"video: frames must be multiples of {factor} pixels when not resized, "
                                 f"got {height}x{width}")
            x = normalize(x, self.mean, self.std)
            if pad := -x.shape[0] % self.temporal_patch_size:
                x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
            flat, (t, h, w) = patchify(x, self.patch_size, self.merge_size, self.temporal_patch_size)
            step = t if self.frames_per_clip is None else self.frames_per_clip
            row = [[min(step, t - s), h, w] for s in range(0, t, step)]
            patches.append(flat)
            clips.extend(row)
            counts.append(len(row))
        return torch.cat(patches), torch.tensor(clips, dtype=torch.long), counts


# transformers' VIDEO_PROCESSOR_NAME: the video processor's settings beside a checkpoint's weights. Its
# `vision_segment_max_frames` is the clip length (temporal patches; null: whole videos) the tower attends over.
VIDEO_PROCESSOR_CONFIG = "video_preprocessor_config.json"


def save_video_processor_config(directory, frames_per_clip: int | None = DEFAULT_FRAMES_PER_CLIP) -> Path:
    """Write ``directory/video_preprocessor_config.json`` with the keys of transformers'
    ``MiniMaxM3VLVideoProcessor`` (its defaults, and ``vision_segment_max_frames = frames_per_clip``), so the clip
    length a model was trained with travels with its weights (`video_frames_per_clip` reads it back)."""
    check_frames_per_clip(frames_per_clip)
    settings = {"video_processor_type": "MiniMaxM3VLVideoProcessor", "processor_class": "MiniMaxM3VLProcessor",
                "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": VIDEO_MIN_PIXELS,
                "max_pixels": VIDEO_MAX_PIXELS, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
                "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "do_convert_rgb": True, "vision_segment_max_frames": frames_per_clip}
    path = Path(directory) / VIDEO_PROCESSOR_CONFIG
    path.write_text(json.dumps(settings, indent=2) + "\n")
    return path


def video_frames_per_clip(directory) -> int | None:
    """The clip length recorded beside a checkpoint: ``vision_segment_max_frames`` of its
    ``video_preprocessor_config.json`` (None: each video one clip), or ``DEFAULT_FRAMES_PER_CLIP`` (transformers'
    default) when the file or the key is absent. A file that is not a JSON object or a bad value raises
    ``ValueError`` naming the file."""
    path = Path(directory) / VIDEO_PROCESSOR_CONFIG
    if not path.is_file():
        return DEFAULT_FRAMES_PER_CLIP
    try:
        settings = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(settings).__name__}")
    return check_frames_per_clip(settings.get("vision_segment_max_frames", DEFAULT_FRAMES_PER_CLIP),
                                 f"{path}: vision_segment_max_frames")


def image_replacement(grid: Sequence[int], merge_size: int = 2) -> str:
    """Prompt text that replaces one image marker, for the image's grid row ``(1, h, w)``."""
    t, h, w = (int(v) for v in grid)
    return VISION_START_TOKEN + IMAGE_TOKEN * (t * h * w // merge_size**2) + VISION_END_TOKEN


def video_replacement(clips: torch.Tensor, meta: VideoMeta | None = None, merge_size: int = 2,
                      temporal_patch_size: int = 2) -> str:
    """Prompt text that replaces one video marker, given the video's clip rows ``clips: [K, 3]``.

    One bracketed run of ``h*w/merge**2`` video tokens per temporal patch, each preceded by the time of
    its first frame when ``meta`` has fps and frame indices."""
    frames = int(clips[:, 0].sum())
    per_frame = int(clips[0, 1] * clips[0, 2]) // merge_size**2
    timed = meta is not None and meta.fps is not None and meta.frames_indices is not None
    out = []
    for frame in range(frames):
        if timed:
            index = meta.frames_indices[min(frame * temporal_patch_size, len(meta.frames_indices) - 1)]
            out.append(timestamp_token(index / meta.fps))
        out.append(VISION_START_TOKEN + VIDEO_TOKEN * per_frame + VISION_END_TOKEN)
    return "".join(out)


def expand_prompt(text: str, image_grid_thw: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                  num_chunks_per_video: Sequence[int] | None = None,
                  video_metadata: Sequence[VideoMeta | None] | None = None, merge_size: int = 2,
                  temporal_patch_size: int = 2) -> str:
    """Replace the i-th image / video marker in ``text`` by the i-th image's / video's placeholder run.

    Raises ``ValueError`` when the number of markers differs from the number of images or videos."""
    n_images = 0 if image_grid_thw is None else image_grid_thw.shape[0]
    n_videos = 0 if num_chunks_per_video is None else len(num_chunks_per_video)
    if text.count(IMAGE_TOKEN) != n_images:
        raise ValueError(f"text: found {text.count(IMAGE_TOKEN)} {IMAGE_TOKEN} markers but {n_images} images")
    if text.count(VIDEO_TOKEN) != n_videos:
        raise ValueError(f"text: found {text.count(VIDEO_TOKEN)} {VIDEO_TOKEN} markers but {n_videos} videos")
    metadata = list(video_metadata) if video_metadata is not None else [None] * n_videos
    if len(metadata) != n_videos:
        raise ValueError(f"video_metadata: expected {n_videos} entries (one per video), got {len(metadata)}")
    starts = np.cumsum([0, *(num_chunks_per_video or [])]).tolist()
    out, image_i, video_i, pos = [], 0, 0, 0
    while True:
        i, v = text.find(IMAGE_TOKEN, pos), text.find(VIDEO_TOKEN, pos)
        if i < 0 and v < 0:
            break
        if v < 0 or 0 <= i < v:
            out.append(text[pos:i] + image_replacement(image_grid_thw[image_i].tolist(), merge_size))
            image_i, pos = image_i + 1, i + len(IMAGE_TOKEN)
        else:
            clips = video_grid_thw[starts[video_i]:starts[video_i + 1]]
            out.append(text[pos:v] + video_replacement(clips, metadata[video_i], merge_size, temporal_patch_size))
            video_i, pos = video_i + 1, v + len(VIDEO_TOKEN)
    out.append(text[pos:])
    return "".join(out)


class M3Processor:
    """Prompt + images + videos -> expanded prompt (and token ids) + packed pixels, as M3's processor.

    ``encode`` (optional) turns the expanded prompt into token ids, e.g. a ``tokenizers`` tokenizer's
    ``lambda s: tok.encode(s).ids``; the tokenizer must know the four vision marker strings as special
    tokens. Videos are not resized here (as in HF); pass ``video_processor`` to change that."""

    def __init__(self, image_processor: M3ImageProcessor | None = None,
                 video_processor: M3VideoProcessor | None = None,
                 encode: Callable[[str], list[int]] | None = None):
        self.image_processor = image_processor or M3ImageProcessor()
        self.video_processor = video_processor or M3VideoProcessor(do_resize=False)
        self.encode = encode

    def __call__(self, text: str, images=None, videos=None,
                 video_metadata: Sequence[VideoMeta | None] | None = None) -> tuple[str, list[int] | None, VisionBatch]:
        """One prompt: ``text`` holds one ``IMAGE_TOKEN`` / ``VIDEO_TOKEN`` marker per image / video, in order.

        Returns ``(prompt, ids, vision)``: the text with each marker expanded into its placeholder run, its token
        ids (``encode(prompt)``; None without ``encode``) and the ``VisionBatch`` of packed pixels and grids
        (``video_metadata``, per video, time-stamps its frames in the prompt). To run them::

            prompt, ids, vision = processor(text, images=[image])
            out = model(torch.tensor(ids), **vision.model_inputs())  # M3ForConditionalGeneration, logits [T, V]
            results, stats = openm3.engine.generate(model, [ids], images=[vision])  # one VisionBatch per prompt

        Raises ``ValueError`` when the markers and the images / videos do not match in number."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        batch = VisionBatch(video_metadata=list(video_metadata) if video_metadata is not None else None)
        if images is not None:
            batch.pixel_values, batch.image_grid_thw = self.image_processor(images)
        if videos is not None:
            batch.pixel_values_videos, batch.video_grid_thw, batch.num_chunks_per_video = self.video_processor(videos)
        vp = self.video_processor
        prompt = expand_prompt(text, batch.image_grid_thw, batch.video_grid_thw, batch.num_chunks_per_video,
                               batch.video_metadata, vp.merge_size, vp.temporal_patch_size)
        ids = self.encode(prompt) if self.encode is not None else None
        return prompt, ids, batch
