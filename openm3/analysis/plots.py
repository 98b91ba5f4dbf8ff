"""PNG figures of a training run: loss curve, text-to-image attention, and the blocks the indexer chose.

matplotlib is imported here only (the `bench`/`demo` extra), with the non-interactive Agg backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_curve(records: list[dict], path: str | Path, title: str = "training loss") -> Path:
    """Loss per optimizer step (and its moving average, overall and per data kind), LR on a second axis, MSA
    stage switch marked. `records`: the trainer's step records (`step`, `loss`, `lr`, `msa_stage`, `loss/<kind>`)."""
    plt = _plt()
    steps = np.array([r["step"] for r in records])
    loss = np.array([r["loss"] for r in records])
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, loss, color="#9ab", lw=1, label="loss (per step)")
    k = max(1, len(loss) // 20)
    if len(loss) >= k > 1:
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, color="#136", lw=2, label=f"moving average ({k} steps)")
    colours = {"text": "#a33", "image": "#36c", "video": "#a7a"}
    for kind, colour in colours.items():
        pts = [(r["step"], r[f"loss/{kind}"]) for r in records if f"loss/{kind}" in r]
        if len(pts) > k:
            xs, ys = map(np.array, zip(*pts))
            ax.plot(xs[k - 1:], np.convolve(ys, np.ones(k) / k, mode="valid"), color=colour, lw=1.2,
                    label=f"{kind} rows (moving average)")
    switch = [r["step"] for r in records if r.get("msa_stage") == "sparse"]
    if switch and switch[0] > steps[0]:
        ax.axvline(switch[0], color="#c60", ls="--", lw=1, label="MSA: dense warm-up -> sparse")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    if "lr" in records[0]:
        ax2 = ax.twinx()
        ax2.plot(steps, [r["lr"] for r in records], color="#7a7", lw=1, alpha=0.7)
        ax2.set_ylabel("learning rate", color="#7a7")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def text_to_image_attention(image: np.ndarray, attn: np.ndarray, grid: tuple[int, int], row_labels: list[str],
                            path: str | Path, title: str = "", focus_row: int = -1, focus_note: str = "") -> Path:
    """`image uint8 [H, W, 3]`; `attn [n_text, n_image_tokens]` attention of text tokens to the image's tokens
    (row-major over the merged `grid = (gh, gw)`). Left: the image; middle: row `focus_row`'s attention laid
    over the image; right: the full text x image-token matrix."""
    plt = _plt()
    gh, gw = grid
    if attn.shape[1] != gh * gw:
        raise ValueError(f"attn must have gh*gw={gh * gw} columns, got {attn.shape}")
    fig, axes = plt.subplots(1, 3, figsize=(12, 4), dpi=120, gridspec_kw={"width_ratios": [1, 1, 1.6]})
    axes[0].imshow(image)
    axes[0].set_title("image")
    axes[1].imshow(image)
    heat = attn[focus_row].reshape(gh, gw)
    axes[1].imshow(heat, cmap="magma", alpha=0.6, extent=(0, image.shape[1], image.shape[0], 0),
                   interpolation="nearest")
    axes[1].set_title(f"attention from {row_labels[focus_row]!r}{focus_note}", fontsize=9)
    for ax in axes[:2]:
        ax.axis("off")
    im = axes[2].imshow(attn, cmap="magma", aspect="auto", interpolation="nearest")
    axes[2].set_yticks(range(len(row_labels)))
    axes[2].set_yticklabels(row_labels, fontsize=7)
    axes[2].set_xlabel("image token (row-major over the merged patch grid)")
    axes[2].set_title("text -> image attention (mean over layers, heads)")
    fig.colorbar(im, ax=axes[2], fraction=0.04)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def indexer_blocks(block_idx: np.ndarray, block_size: int, path: str | Path, title: str = "") -> Path:
    """`block_idx int [T, topk]` of one index head (-1 unused): which key blocks each query selected.
    Dark cells are selected blocks; the diagonal band is the forced local block; grey is outside causality."""
    plt = _plt()
    t = block_idx.shape[0]
    n_blocks = (t + block_size - 1) // block_size
    chosen = np.zeros((t, n_blocks))
    for q in range(t):
        for b in block_idx[q]:
            if b >= 0:
                chosen[q, b] = 1.0
    own = np.arange(t) // block_size
    future = np.arange(n_blocks)[None, :] > own[:, None]
    shown = np.where(future, np.nan, chosen)
    fig, ax = plt.subplots(figsize=(6, 6), dpi=120)
    cmap = plt.get_cmap("Blues").with_extremes(bad="#eee")
    ax.imshow(shown, cmap=cmap, aspect="auto", interpolation="nearest", vmin=0, vmax=1.2,
              extent=(0, n_blocks, t, 0))
    ax.set_xlabel(f"key block ({block_size} tokens each)")
    ax.set_ylabel("query token")
    ax.set_title(title or "blocks chosen by the indexer")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
