"""Verdicts: the conclusions a chapter draws from its measurements, computed.

Measured numbers (times, rates, accuracies after training, rounding errors)
vary between machines and runs; the conclusions the text draws from them must
not. A ``Verdict`` is one such conclusion: a claim with its tolerance, whether
it holds, and the measurement behind it. Printed, it reads

    ✓ 2 loader workers are faster than 0: yes  [measured 1.62×, noise ±8%]
    ✗ compiled is faster than eager (at least 2x): NO  [measured 1.10×, noise ±5%]

The course's notebook checks (nbval) compare the claim and the answer, and the
sanitiser masks the bracketed measurement (pattern ``verdict-evidence`` in
``tests/nbval_sanitize.cfg``), so the same stored output passes on every CPU
while a conclusion that flips fails. ``tools/execute_notebooks.py`` refuses to
store a notebook with a verdict that does not hold.

Timing comparisons account for noise: each ``Timing`` carries the
interquartile range of its repeats, and a difference smaller than the combined
relative spread (never less than ``NOISE_FLOOR``) is "no measurable
difference", not a speed-up or a slow-down. Used in every chapter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import torch

from companion.harness.timing import OtherLoad, Timing, format_ratio

__all__ = [
    "HELD_SHARE",
    "NOISE_FLOOR",
    "SpeedComparison",
    "Verdict",
    "check",
    "check_close",
    "check_faster",
    "check_not_faster",
    "check_range",
    "check_speed_ups_at_most",
    "check_unless_loaded",
    "compare_speed",
]

# Relative noise assumed even when a run's repeats agree closely: the spread
# between two runs of the same benchmark is larger than within one run.
NOISE_FLOOR = 0.05
# The share of this process's cores that other programs may take before a
# comparison of thread counts, or a cost model of processes that wait for each
# other, stops being evidence (companion.harness.timing.OtherLoad measures it: a
# quarter of a core on two cores).
HELD_SHARE = 0.125


@dataclass(frozen=True)
class Verdict:
    """A claim, whether it holds, and the measurement it was decided on."""

    claim: str  # states its own tolerance, e.g. "matches DDP within 1e-05"
    holds: bool
    evidence: str = ""  # measured values; they vary between machines

    def __bool__(self) -> bool:
        return self.holds

    def __str__(self) -> str:
        mark, answer = ("✓", "yes") if self.holds else ("✗", "NO")
        line = f"{mark} {self.claim}: {answer}"
        return f"{line}  [measured {self.evidence}]" if self.evidence else line

    def __repr__(self) -> str:
        return str(self)


def check(claim: str, holds: bool, evidence: str = "") -> Verdict:
    """Return the verdict on ``claim``, decided by the caller (``holds``)."""
    return Verdict(claim, bool(holds), evidence)


def _flatten(values: object) -> torch.Tensor:
    """One float64 vector from a number, a tensor, or a sequence of them."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float64).flatten()
    if isinstance(values, (int, float)):
        return torch.tensor([float(values)], dtype=torch.float64)
    if isinstance(values, Iterable) and not isinstance(values, (str, bytes)):
        parts = [_flatten(v) for v in values]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    raise TypeError(
        f"Cannot compare a {type(values).__name__}; give numbers or tensors."
    )


def check_close(
    claim: str,
    actual: object,
    expected: object,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> Verdict:
    """Do ``actual`` and ``expected`` agree elementwise within ``atol + rtol * |expected|``?

    Both may be numbers, tensors, or sequences of them (compared in order, as
    one long vector). The tolerance is appended to the claim.
    """
    if atol < 0 or rtol < 0 or (atol == 0 and rtol == 0):
        raise ValueError(
            "Give a positive atol or rtol: an exact comparison is check(a == b)."
        )
    a, e = _flatten(actual), _flatten(expected)
    if a.shape != e.shape:
        return check(f"{claim}", False, f"{a.numel()} values vs {e.numel()} expected")
    diff = (a - e).abs()
    allowed = atol + rtol * e.abs()
    holds = bool((diff <= allowed).all()) and bool(torch.isfinite(a).all())
    worst = diff.max().item() if diff.numel() else 0.0
    tolerance = " + ".join(
        text
        for text, on in ((f"{atol:.0e}", atol), (f"{rtol:.0e} x |expected|", rtol))
        if on
    )
    return check(
        f"{claim} (within {tolerance})", holds, f"max |difference| {worst:.1e}"
    )


def check_range(
    claim: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    fmt: str = ".3g",
) -> Verdict:
    """Is ``low <= value <= high``? The bounds are appended to the claim."""
    if low is None and high is None:
        raise ValueError("Give low, high or both.")
    if low is not None and high is not None and low > high:
        raise ValueError(f"low ({low}) is above high ({high}).")
    if low is not None and high is not None:
        bounds = f"between {low:{fmt}} and {high:{fmt}}"
    elif low is not None:
        bounds = f"at least {low:{fmt}}"
    else:
        bounds = f"at most {high:{fmt}}"
    holds = (
        math.isfinite(value)
        and (low is None or value >= low)
        and (high is None or value <= high)
    )
    return check(f"{claim} ({bounds})", holds, f"{value:{fmt}}")


@dataclass(frozen=True)
class SpeedComparison:
    """How much faster ``fast`` ran than ``slow``, and whether that is above noise."""

    ratio: float  # slow.median / fast.median: above 1, "fast" was faster
    noise: float  # relative spread both timings allow, at least NOISE_FLOOR
    outcome: Literal["faster", "slower", "no measurable difference"]

    @property
    def evidence(self) -> str:
        return f"{format_ratio(self.ratio)}, noise ±{self.noise:.0%}"


def compare_speed(fast: Timing, slow: Timing) -> SpeedComparison:
    """Compare two timings, with their relative interquartile ranges as the noise band.

    The outcome is "faster" when ``fast`` ran faster than ``slow`` by more than
    the noise, "slower" when it ran slower by more than the noise, else "no
    measurable difference".
    """
    if fast.median <= 0 or slow.median <= 0:
        raise ValueError("Timings must be positive.")
    ratio = slow.median / fast.median
    noise = max(NOISE_FLOOR, fast.iqr / fast.median + slow.iqr / slow.median)
    if ratio > 1 + noise:
        outcome = "faster"
    elif ratio < 1 / (1 + noise):
        outcome = "slower"
    else:
        outcome = "no measurable difference"
    return SpeedComparison(ratio, noise, outcome)


def check_faster(
    claim: str, fast: Timing, slow: Timing, *, at_least: float = 1.0
) -> Verdict:
    """Did ``fast`` run faster than ``slow``, by at least ``at_least`` even at the edge of the noise?

    With ``at_least=1`` any speed-up above noise counts; with ``at_least=2``
    the ratio divided by (1 + noise) must still be 2 or more.
    """
    if at_least < 1:
        raise ValueError(f"at_least is a speed-up, 1 or more, not {at_least}.")
    c = compare_speed(fast, slow)
    holds = c.outcome == "faster" and c.ratio / (1 + c.noise) >= at_least
    if at_least > 1:
        claim = f"{claim} (at least {at_least:g}x)"
    return check(claim, holds, c.evidence)


def check_not_faster(
    claim: str,
    candidate: Timing,
    reference: Timing,
    *,
    others: OtherLoad | None = None,
) -> Verdict:
    """Is ``candidate`` not measurably faster than ``reference`` (equal within noise, or slower)?

    Where the claim holds only on free cores (fewer threads not faster than
    more), give ``others``, what other programs took on this process's cores
    meanwhile: the claim then reads "..., or other programs took 1/8 of the
    cores", and holds too where they took at least ``HELD_SHARE`` of them,
    whatever the candidate won by. No fixed factor bounds the loss a held
    core causes: each product of the threads waits, at each of its
    synchronisation points (OpenMP's fork and join), for the thread that
    shares a core with the other program, a scheduler slice or more each time
    (on the two-core machine the course was written on, one core held, two
    intra-op threads measured 2.8x slower than one beyond the noise, and in a
    flake hunt more than 4x). The verdict can still fail where other programs
    took less, which is where it is tested; a load that ``OtherLoad`` does not
    count (a CPU quota, a hyperthread sibling outside the affinity) still
    fails it.
    """
    c = compare_speed(candidate, reference)
    if others is None:
        return check(claim, c.outcome != "faster", c.evidence)
    return check_unless_loaded(claim, c.outcome != "faster", c.evidence, others)


def check_unless_loaded(
    claim: str, holds: bool, evidence: str, others: OtherLoad
) -> Verdict:
    """``check(claim, holds, evidence)``, excused where other programs took the cores.

    For a claim that holds only on cores the measured program has to itself
    (a cost model of processes that wait for each other, a comparison of
    thread counts, a speed-up of threads that each wait at a join for a held
    core): it reads "..., or other programs took 1/8 of the cores",
    and holds too where ``others`` (what ``OtherLoad`` measured meanwhile)
    took at least ``HELD_SHARE`` of them. A process that waits for a peer
    whose core another program holds waits a scheduler slice or more, each
    time, and no fixed factor bounds that. The verdict can still fail where
    other programs took less, which is where it is tested.
    """
    held = others.cores >= HELD_SHARE * others.available
    load = f"other programs: {others.cores:.2f} of {others.available} cores"
    excused = "; excused by their load" if held and not holds else ""
    return check(
        f"{claim}, or other programs took {Fraction(HELD_SHARE)} of the cores",
        holds or held,
        f"{evidence}; {load}{excused}",
    )


def check_speed_ups_at_most(
    claim: str, candidates: Iterable[Timing], reference: Timing, *, at_most: float
) -> Verdict:
    """Is every candidate's speed-up over ``reference`` at most ``at_most``, within the noise?

    The mirror of ``check_faster``: a candidate breaks the bound only if its
    speed-up divided by (1 + noise) is still above ``at_most``. The evidence is
    the candidate that came closest to breaking it.
    """
    if at_most < 1:
        raise ValueError(f"at_most is a speed-up, 1 or more, not {at_most}.")
    comparisons = [compare_speed(candidate, reference) for candidate in candidates]
    if not comparisons:
        raise ValueError("No candidate timings to compare.")
    closest = max(comparisons, key=lambda c: c.ratio / (1 + c.noise))
    holds = closest.ratio / (1 + closest.noise) <= at_most
    return check(
        f"{claim} (at most {at_most:g}x, within the noise)",
        holds,
        f"largest {closest.evidence}",
    )
