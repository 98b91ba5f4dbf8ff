"""Training recipes: when vision is on, the data mixture, and the learning-rate plan.

Every recipe trains on the same **text-token budget**: each optimizer step holds `text_rows` packed rows of
text-corpus tokens whatever the recipe, and vision rows (image and video samples) are added on top of them while
vision is on. So `text-only`, `native`, `mid` and `cpt` see the same text tokens in the same order, and any
difference in held-out text quality comes from the vision data and when it arrived.

- `text-only`: never vision.
- `native`:    text + vision from step 0 (M3's choice).
- `mid`:       vision switched on at `vision_start_step`, a step before the LR decay starts.
- `cpt`:       continued pre-training: the WSD schedule runs (and fully decays) over the first
               `steps - cpt_steps` steps on text only (its decay start scaled by the same fraction), then vision
               is switched on for the last `cpt_steps` steps at a constant `cpt_lr_ratio * lr`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schedule import WSDSchedule

RECIPES = ("text-only", "native", "mid", "cpt")
DATA_KINDS = ("text", "image", "video")


def default_mixture() -> dict[str, float]:
    """Rows of each kind per text row while vision is on: 4 text : 3 image : 1 video."""
    return {"text": 1.0, "image": 0.75, "video": 0.25}


@dataclass(frozen=True)
class RecipePlan:
    """What a recipe does at each optimizer step.

    `rows(step)` gives the number of packed rows of each data kind in that step's global batch;
    `lr_multiplier(step)` scales the peak learning rate.
    """

    name: str
    steps: int
    text_rows: int
    mixture: dict[str, float] = field(default_factory=default_mixture)
    schedule: WSDSchedule | None = None
    vision_start_step: int | None = None  # None: never
    cpt_lr_ratio: float = 0.3

    def vision_on(self, step: int) -> bool:
        return self.vision_start_step is not None and step >= self.vision_start_step

    def rows(self, step: int) -> dict[str, int]:
        """Rows of each kind (text, image, video) for `step`; text is the same at every step."""
        out = {"text": self.text_rows, "image": 0, "video": 0}
        if self.vision_on(step):
            for kind in ("image", "video"):
                out[kind] = int(round(self.text_rows * self.mixture.get(kind, 0.0) / self.mixture["text"]))
        return out

    def lr_multiplier(self, step: int) -> float:
        if self.name == "cpt" and step >= self.schedule.total_steps:
            return self.cpt_lr_ratio
        return self.schedule(step)

    def text_token_budget(self, seq_len: int) -> int:
        """Text-corpus tokens over the whole run (identical across recipes for the same settings)."""
        return self.steps * self.text_rows * seq_len


def make_plan(recipe: str, *, steps: int, text_rows: int, warmup_steps: int, decay_start: int,
              min_lr_ratio: float = 0.1, decay_shape: str = "linear", mixture: dict[str, float] | None = None,
              vision_start_step: int | None = None, cpt_steps: int | None = None,
              cpt_lr_ratio: float = 0.3) -> RecipePlan:
    """Validate a recipe's settings and build its plan. Raises ValueError naming the bad setting."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if steps <= 0:
        raise ValueError(f"steps must be > 0, got {steps}")
    if text_rows <= 0:
        raise ValueError(f"text_rows must be > 0, got {text_rows}")
    mixture = dict(default_mixture() if mixture is None else mixture)
    unknown = set(mixture) - set(DATA_KINDS)
    if unknown:
        raise ValueError(f"mixture has unknown data kinds {sorted(unknown)}; expected keys from {DATA_KINDS}")
    if mixture.get("text", 0.0) <= 0 or any(v < 0 for v in mixture.values()):
        raise ValueError(f"mixture needs a positive 'text' share and non-negative others, got {mixture}")
    if recipe != "cpt" and cpt_steps is not None:
        raise ValueError(f"cpt_steps is only meaningful for recipe 'cpt', got recipe {recipe!r}")
    if recipe != "mid" and vision_start_step is not None:
        raise ValueError(f"vision_start_step is only meaningful for recipe 'mid', got recipe {recipe!r}")

    main_steps = steps
    if recipe == "cpt":
        cpt_steps = max(1, steps // 5) if cpt_steps is None else cpt_steps
        if not 0 < cpt_steps < steps:
            raise ValueError(f"cpt_steps must be in (0, steps={steps}), got {cpt_steps}")
        main_steps = steps - cpt_steps
        decay_start = round(decay_start * main_steps / steps)  # same decay fraction, within the main phase
    schedule = WSDSchedule(total_steps=main_steps, warmup_steps=warmup_steps, decay_start=decay_start,
                           min_lr_ratio=min_lr_ratio, decay_shape=decay_shape)

    start = {"text-only": None, "native": 0, "cpt": main_steps}.get(recipe)
    if recipe == "mid":
        start = decay_start // 2 if vision_start_step is None else vision_start_step
        if not 0 < start < decay_start:
            raise ValueError(f"recipe 'mid' switches vision on before the decay: vision_start_step must be in "
                             f"(0, decay_start={decay_start}), got {start}")
    return RecipePlan(name=recipe, steps=steps, text_rows=text_rows, mixture=mixture, schedule=schedule,
                      vision_start_step=start, cpt_lr_ratio=cpt_lr_ratio)
