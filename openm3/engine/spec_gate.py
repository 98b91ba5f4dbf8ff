"""Whether a decode step should speculate: only when the drafts it is expected to keep pay for its longer step.

A speculative step feeds every sequence of the batch its last token and K drafts (`speculative.step_drafts`), so
it costs more than a plain step: on an H100, m3-small at a 128K prompt took 6.33 ms for 1 + 7 tokens against
4.40 ms for one (1.44x), and in a large batch, or on a CPU, the extra tokens cost more. Where the lookups are
seldom right (a random model's answers, prose that repeats nothing) speculation is slower than plain decoding.

`SpeculationGate` compares the expected tokens per second of the two kinds of step for the batch at hand:
plain B / t_plain(B) against (B + m a) / t_spec(B), where B is the batch's size, m the sequences whose lookup
found drafts, a the drafts a sequence keeps per step (a moving average) and t the step's wall time by batch size
and kind (the median of the last few such steps: a host hiccup does not move it; the first step of each kind and
size, and steps that compiled or captured a CUDA graph, are left out). Until both times are measured the ratio
t_spec / t_plain is a prior, 1 + 0.06 K for K drafts per sequence (`PRIOR_PER_DRAFT`), fitted to what a GPU
measured: H100, m3-small, CUDA graphs (session 32), K = 4 at a 128K prompt 6.03 / 5.24 ms = 1.15 and at 8 x 16K
7.67 / 6.21 ms = 1.24; K = 7 at 128K 6.33 / 4.40 ms = 1.44. (A fixed 1.5 made the gate decline drafts right a
quarter of the time at K = 4, which would have paid: 0.99x plain against 1.07x ungated at 128K; and since a
declined step measures no speculative time, it never learnt otherwise.) Where the step costs more (a CPU, a
large batch) the first measured speculative steps correct it. Where only the measured ratio says no (the kept
rate would pay at the prior one), every `probe_every`-th such step speculates anyway, so a cost measured once on
a busy host is measured again.

The kept-draft rate is learnt from speculative steps, and also where the gate says no: the drafts a sequence was
offered at a plain step are kept aside ("shadow" drafts) and checked against the tokens the plain steps then
give, which is how many a speculative step would have kept (exactly so for greedy decoding: a draft is kept
when it equals the model's pick). So the gate follows a sequence that starts repeating its context without
speculating blindly. Until anything is known it decodes plainly; shadows still matching count for their matches
so far where that is enough to say yes, so right drafts are taken from the third step on.
"""

from __future__ import annotations

import collections
import statistics
from typing import Hashable, Sequence

__all__ = ["SpeculationGate", "PRIOR_PER_DRAFT"]

PRIOR_PER_DRAFT = 0.06  # the prior t_spec / t_plain is 1 + this x drafts per sequence (module docstring)


class SpeculationGate:
    """The gate of one engine (see the module docstring). prior_ratio: t_spec / t_plain until both are measured
    (None: 1 + `PRIOR_PER_DRAFT` x the step's drafts per sequence); weight: each observation's share in the kept-draft
    average (1/16: about the last 16 sequence-steps); time_window: steps whose median is a step time;
    probe_every: see the module docstring; use_times: False keeps the prior whatever the steps took (a
    decision that does not depend on the host's load: tests).

    Use: `speculate(keys, drafts)` before a step (keys: the batch's sequences, drafts: each one's lookup, [] for
    none); then `record(keys, tokens, seconds, speculative=, accepted=)` after it (tokens: each sequence's new
    tokens; seconds: the step's wall time, None to leave it out; accepted: the drafts a speculative step kept)."""

    def __init__(self, prior_ratio: float | None = None, weight: float = 1 / 16, time_window: int = 9,
                 probe_every: int = 32, use_times: bool = True):
        if prior_ratio is not None and not prior_ratio >= 1.0:
            raise ValueError(f"prior_ratio must be >= 1 (a speculative step costs at least a plain one), "
                             f"got {prior_ratio!r}")
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        for name, value in (("time_window", time_window), ("probe_every", probe_every)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.prior_ratio, self.weight, self.probe_every = prior_ratio, weight, probe_every
        self.use_times = use_times
        self.kept_rate: float | None = None  # drafts kept per sequence-step that had drafts
        self._times: dict[tuple[int, bool], collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=time_window))  # (batch size, speculative) -> recent step seconds
        self._costly = 0  # steps declined since the last speculative one where only the measured ratio said no
        self._seen: set[tuple[int, bool]] = set()  # kinds whose first step was left out
        self._shadows: dict[Hashable, list] = {}  # key -> [drafts, matched so far]
        self._found = 0  # sequences with drafts at the last step the gate let speculate
        self.said_yes = 0
        self.said_no = 0

    def step_s(self, batch: int, speculative: bool) -> float | None:
        """The median wall time of the recent timed steps of this batch size and kind (None: none yet)."""
        times = self._times.get((batch, speculative))
        return statistics.median(times) if times else None

    def prior(self, drafts: int) -> float:
        """The t_spec / t_plain assumed before it is measured, for steps of `drafts` drafts per sequence."""
        return self.prior_ratio if self.prior_ratio is not None else 1.0 + PRIOR_PER_DRAFT * drafts

    def ratio(self, batch: int, drafts: int) -> float:
        """t_spec / t_plain for a batch of `batch` sequences: measured, else the prior for `drafts` drafts."""
        spec, plain = self.step_s(batch, True), self.step_s(batch, False)
        if not self.use_times or spec is None or plain is None:
            return self.prior(drafts)
        return spec / plain

    def speculate(self, keys: Sequence[Hashable], drafts: Sequence[Sequence[int]]) -> bool:
        """Whether the step of the sequences `keys`, whose lookups found `drafts`, should feed them. When not,
        sequences without a shadow pending take these drafts as their shadow."""
        present = set(keys)
        for key in [k for k in self._shadows if k not in present]:  # sequences that left the batch
            del self._shadows[key]
        found = sum(1 for d in drafts if d)
        k = max((len(d) for d in drafts), default=0)
        yes = found > 0 and self._pays(len(keys), found, self.kept_rate, k)
        started = [self._shadows[k] for k in keys if k in self._shadows and self._shadows[k][1] > 0]
        if not yes and found > 0 and started:
            # shadows still matching are worth their matches so far at least: settled at them where that says yes
            # (a right shadow of K drafts would take K plain steps to settle in full)
            rate = self.kept_rate
            for _, matched in started:
                rate = self._mean(rate, float(matched))
            if self._pays(len(keys), found, rate, k):
                self.kept_rate, yes = rate, True
        if not yes and found > 0 and self._pays(len(keys), found, self.kept_rate, k, self.prior(k)):
            self._costly += 1  # only the measured cost says no
            yes = self._costly >= self.probe_every
        if yes:
            self.said_yes, self._found, self._costly = self.said_yes + 1, found, 0
            self._shadows.clear()  # the step's own verification measures them now
            return True
        self.said_no += 1
        for key, d in zip(keys, drafts):
            if d and key not in self._shadows:
                self._shadows[key] = [list(d), 0]
        return False

    def record(self, keys: Sequence[Hashable], tokens: Sequence[Sequence[int]], seconds: float | None, *,
               speculative: bool, accepted: int = 0) -> None:
        """After a step: its wall time (None: leave it out), the new tokens of each sequence (they settle the
        shadows), and for a speculative step the drafts it kept (`accepted`, over the sequences whose lookup found
        some)."""
        kind = (len(keys), speculative)
        if seconds is not None:
            if kind not in self._seen:
                self._seen.add(kind)  # the first step of a kind and size compiles or fills host caches
            else:
                self._times[kind].append(seconds)
        if speculative:
            for _ in range(self._found):
                self._observe(accepted / self._found)
            return
        for key, new in zip(keys, tokens):
            shadow = self._shadows.get(key)
            if shadow is None:
                continue
            offered, matched = shadow
            settled = False
            for token in new:
                if token != offered[matched]:
                    settled = True
                    break
                matched += 1
                if matched == len(offered):
                    settled = True
                    break
            if settled:
                del self._shadows[key]
                self._observe(float(matched))
            else:  # every new token matched a draft; more may follow
                shadow[1] = matched

    def _pays(self, batch: int, found: int, rate: float | None, drafts: int, ratio: float | None = None) -> bool:
        return rate is not None and batch + found * rate > batch * (self.ratio(batch, drafts) if ratio is None
                                                                     else ratio)

    def _mean(self, rate: float | None, kept: float) -> float:
        return kept if rate is None else rate + self.weight * (kept - rate)

    def _observe(self, kept: float) -> None:
        self.kept_rate = self._mean(self.kept_rate, kept)

    def describe(self) -> str:
        rate = "unknown" if self.kept_rate is None else f"{self.kept_rate:.2f}"
        sizes = sorted({batch for batch, _ in self._times})
        nan = float("nan")
        costs = ", ".join(f"{b}: {self.step_s(b, True) or nan:.5f} / {self.step_s(b, False) or nan:.5f} s"
                          for b in sizes)
        return (f"speculation gate: {self.said_yes} speculative steps, {self.said_no} plain; "
                f"drafts kept per drafted sequence-step {rate}; step times (speculative / plain) by batch size "
                f"{{{costs}}}")
