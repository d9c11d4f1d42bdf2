"""Verdicts: claims with tolerances, decided from measurements, noise-aware."""

import math
from types import SimpleNamespace

import pytest
import torch

from companion.harness.timing import Timing
from companion.harness.verdicts import (
    HELD_SHARE,
    NOISE_FLOOR,
    check,
    check_close,
    check_faster,
    check_not_faster,
    check_range,
    check_speed_ups_at_most,
    check_unless_loaded,
    compare_speed,
)


def timing(median: float, iqr: float = 0.0) -> Timing:
    return Timing("t", median, iqr, 7, "hw", 1)


def test_printed_form_separates_claim_from_measurement():
    assert (
        str(check("x is even", True, "x = 4")) == "✓ x is even: yes  [measured x = 4]"
    )
    assert (
        str(check("x is even", False, "x = 3")) == "✗ x is even: NO  [measured x = 3]"
    )
    assert str(check("no evidence", True)) == "✓ no evidence: yes"
    assert repr(check("x is even", True)) == "✓ x is even: yes"  # as the REPL shows it
    assert bool(check("c", True)) and not bool(check("c", False))


def test_check_close_states_tolerance_and_worst_difference():
    v = check_close("equal", torch.tensor([1.0, 2.0]), [1.0, 2.0 + 3e-6], atol=1e-5)
    assert v.holds
    assert v.claim == "equal (within 1e-05)"
    assert v.evidence == "max |difference| 3.0e-06"
    assert not check_close("equal", 1.0, 1.0 + 2e-5, atol=1e-5).holds


def test_check_close_relative_tolerance_scales_with_expected():
    assert check_close("rel", 1000.5, 1000.0, rtol=1e-3).holds
    assert not check_close("rel", 1.5, 1.0, rtol=1e-3).holds
    assert "1e-03 x |expected|" in check_close("rel", 1.0, 1.0, rtol=1e-3).claim


def test_check_close_sequences_of_tensors_and_mismatches():
    a = [torch.ones(2, 2), torch.zeros(3)]
    b = [torch.ones(2, 2), torch.zeros(3)]
    b[1][2] = 0.5
    verdict = check_close("params", a, b, atol=0.1)
    assert not verdict.holds and verdict.evidence == "max |difference| 5.0e-01"
    assert not check_close("shape", torch.ones(3), torch.ones(4), atol=1).holds
    assert not check_close("nan", float("nan"), 0.0, atol=1).holds


def test_check_close_refuses_zero_tolerance():
    with pytest.raises(ValueError, match="positive atol or rtol"):
        check_close("x", 1.0, 1.0)


@pytest.mark.parametrize(
    ("value", "low", "high", "holds", "claim"),
    [
        (0.9, 0.85, None, True, "acc (at least 0.85)"),
        (0.8, 0.85, None, False, "acc (at least 0.85)"),
        (0.5, None, 0.6, True, "acc (at most 0.6)"),
        (1.3, 0.75, 1.25, False, "acc (between 0.75 and 1.25)"),
        (1.25, 0.75, 1.25, True, "acc (between 0.75 and 1.25)"),
        (math.nan, 0.0, None, False, "acc (at least 0)"),
    ],
)
def test_check_range(value, low, high, holds, claim):
    verdict = check_range("acc", value, low=low, high=high)
    assert verdict.holds is holds
    assert verdict.claim == claim


def test_check_range_needs_a_bound():
    with pytest.raises(ValueError):
        check_range("x", 1.0)
    with pytest.raises(ValueError):
        check_range("x", 1.0, low=2, high=1)


def test_compare_speed_uses_the_noise_floor_when_repeats_agree():
    c = compare_speed(timing(1.0), timing(1.04))  # 4 % is within the 5 % floor
    assert c.noise == NOISE_FLOOR
    assert c.outcome == "no measurable difference"
    assert compare_speed(timing(1.0), timing(1.06)).outcome == "faster"
    assert compare_speed(timing(1.06), timing(1.0)).outcome == "slower"


def test_compare_speed_widens_the_band_with_the_spread():
    # 20 % relative IQR on each side: a 1.3x ratio is not above 1 + 0.4.
    c = compare_speed(timing(1.0, 0.2), timing(1.3, 0.26))
    assert c.noise == pytest.approx(0.4)
    assert c.outcome == "no measurable difference"
    assert c.evidence == "1.30×, noise ±40%"


def test_check_faster_requires_the_speed_up_beyond_the_noise():
    assert check_faster(
        "f", timing(1.0), timing(2.2), at_least=2
    ).holds  # 2.2 / 1.05 >= 2
    assert not check_faster(
        "f", timing(1.0), timing(2.05), at_least=2
    ).holds  # 2.05 / 1.05 < 2
    assert not check_faster("f", timing(1.0), timing(1.03)).holds
    assert (
        check_faster("f", timing(1.0), timing(2.0), at_least=1.5).claim
        == "f (at least 1.5x)"
    )
    with pytest.raises(ValueError):
        check_faster("f", timing(1.0), timing(2.0), at_least=0.5)


def test_check_not_faster_accepts_equal_and_slower():
    assert check_not_faster("n", timing(1.0), timing(1.03)).holds  # within noise
    assert check_not_faster("n", timing(2.0), timing(1.0)).holds  # slower
    assert not check_not_faster("n", timing(1.0), timing(1.5)).holds  # clearly faster


def test_check_speed_ups_at_most_allows_the_noise_and_names_the_closest():
    reference = timing(3.0)
    within = check_speed_ups_at_most(
        "s", [timing(2.0), timing(3.3)], reference, at_most=1.5
    )
    assert within.holds and within.claim == "s (at most 1.5x, within the noise)"
    assert within.evidence == "largest 1.50×, noise ±5%"
    # 3.2 / 2.0 = 1.6 is above 1.5 but within 1.5 x 1.1, with 5 % spread on each side.
    assert check_speed_ups_at_most(
        "s", [timing(2.0, 0.1)], timing(3.2, 0.16), at_most=1.5
    ).holds
    assert not check_speed_ups_at_most(
        "s", [timing(3.0), timing(1.0)], reference, at_most=2
    ).holds
    with pytest.raises(ValueError, match="at_most"):
        check_speed_ups_at_most("s", [timing(1.0)], reference, at_most=0.5)
    with pytest.raises(ValueError, match="No candidate"):
        check_speed_ups_at_most("s", [], reference, at_most=2)


def test_timing_from_samples_median_and_iqr():
    t = Timing.from_samples("epochs", [0.3, 0.1, 0.2, 0.4, 0.5], threads=3)
    assert t.median == 0.3
    assert t.iqr == pytest.approx(0.45 - 0.15)
    assert t.runs == 5 and t.threads == 3
    assert t.hardware.endswith(", 3 threads")
    with pytest.raises(ValueError):
        Timing.from_samples("none", [])


def test_format_table_names_the_threads_the_timings_used():
    from companion.harness.timing import format_table

    rows = [
        {"what": "a", "time": timing(1e-3)},
        {"what": "b", "time": Timing("t", 1e-3, 0, 7, "hw", 2)},
    ]
    assert format_table(rows).splitlines()[-1].endswith(", 1 and 2 threads")
    assert format_table([{"what": "a", "time": "1 ms"}], threads=1).endswith(
        ", 1 thread"
    )


# Edges and exact texts: each test below fails on a mutant that survived a
# mutmut run (a strict comparison for a non-strict one, a changed default, a
# dropped or rewritten message or measurement).


def test_check_close_at_the_tolerance_and_with_both_tolerances():
    assert check_close("edge", 1.5, 1.0, atol=0.5).holds  # difference == allowed
    both = check_close("both", 1.0, 1.0, atol=1e-5, rtol=1e-3)
    assert both.claim == "both (within 1e-05 + 1e-03 x |expected|)"


def test_check_close_of_nothing_and_of_different_lengths():
    empty = check_close("empty", [], [], atol=1)
    assert empty.holds and empty.evidence == "max |difference| 0.0e+00"
    short = check_close("shape", [], [0.0], atol=1)
    assert (short.claim, short.holds, short.evidence) == (
        "shape",
        False,
        "0 values vs 1 expected",
    )


def test_check_close_refuses_what_it_cannot_compare():
    for values, name in (("1.0", "str"), (None, "NoneType")):
        with pytest.raises(TypeError, match=rf"^Cannot compare a {name}; give"):
            check_close("x", values, 1.0, atol=1)
    with pytest.raises(ValueError, match=r"^Give a positive atol or rtol: an exact"):
        check_close("x", 1.0, 1.0, atol=-1.0, rtol=1e-3)


def test_check_range_at_its_bounds_and_its_exact_texts():
    at_low = check_range("x", 0.85, low=0.85)
    assert at_low.holds and at_low.evidence == "0.85"
    assert check_range("x", 1.0, low=1, high=1).holds  # equal bounds are a point
    assert check_range("x", 1e-5, high=1).evidence == "1e-05"
    with pytest.raises(ValueError, match=r"^Give low, high or both\.$"):
        check_range("x", 1.0)
    with pytest.raises(ValueError, match=r"^low \(2\) is above high \(1\)\.$"):
        check_range("x", 1.0, low=2, high=1)


def test_compare_speed_at_the_edges_of_the_noise_band():
    # Noise 0.25 from the IQR; 1.25 and 1 / 1.25 are exact in binary.
    edge = compare_speed(timing(1.0, 0.25), timing(1.25))
    assert (edge.noise, edge.outcome) == (0.25, "no measurable difference")
    assert compare_speed(timing(1.25), timing(1.0, 0.25)).outcome == (
        "no measurable difference"
    )
    assert compare_speed(timing(2.0, 0.5), timing(4.0)).noise == 0.25  # IQR / median
    for fast, slow in ((0.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError, match=r"^Timings must be positive\.$"):
            compare_speed(timing(fast), timing(slow))


def test_check_faster_default_edge_and_texts():
    plain = check_faster("f", timing(1.0), timing(1.5))  # any speed-up above noise
    assert (plain.claim, plain.holds, plain.evidence) == (
        "f",
        True,
        "1.50×, noise ±5%",
    )
    assert check_faster(
        "f", timing(1.0, 0.25), timing(2.5), at_least=2
    ).holds  # 2.5/1.25
    with pytest.raises(ValueError, match=r"^at_least is a speed-up, 1 or more, not"):
        check_faster("f", timing(1.0), timing(2.0), at_least=0.5)


def test_check_not_faster_keeps_claim_and_evidence():
    v = check_not_faster("n", timing(1.0), timing(1.5))
    assert (v.claim, v.holds, v.evidence) == ("n", False, "1.50×, noise ±5%")


def test_check_speed_ups_at_most_picks_the_closest_after_the_noise():
    # A: 1.5x with 5 % noise (1.43 after it); B: 2x with 50 % noise (1.33 after it).
    a, b = timing(2.0), timing(1.5, 0.75)
    v = check_speed_ups_at_most("s", [b, a], timing(3.0), at_most=1.45)
    assert v.evidence == "largest 1.50×, noise ±5%"
    assert check_speed_ups_at_most(
        "s", [timing(1.0, 0.25)], timing(2.5), at_most=2
    ).holds  # exactly at the bound
    assert check_speed_ups_at_most("s", [timing(1.0)], timing(1.0), at_most=1).holds
    with pytest.raises(ValueError, match=r"^No candidate timings to compare\.$"):
        check_speed_ups_at_most("s", [], timing(1.0), at_most=2)


def load(cores: float, available: int = 2) -> SimpleNamespace:
    """What OtherLoad reports: other programs' cores' worth, of ``available``."""
    return SimpleNamespace(cores=cores, available=available)


def test_check_not_faster_with_others_excuses_a_loss_only_where_others_took_an_eighth():
    faster = timing(1.0), timing(1.5)  # the candidate is clearly faster
    quiet = check_not_faster("n", *faster, others=load(0.02))
    assert quiet.claim == "n, or other programs took 1/8 of the cores"
    assert not quiet.holds
    assert quiet.evidence == "1.50×, noise ±5%; other programs: 0.02 of 2 cores"
    held = check_not_faster("n", *faster, others=load(HELD_SHARE * 2))
    assert held.holds and held.evidence.endswith("; excused by their load")
    # A held core can slow all threads by any factor (slices at every fork and join),
    assert check_not_faster("n", timing(1.0), timing(5.0), others=load(1.0)).holds
    # but not below an eighth of the cores, and never on a quiet machine.
    assert not check_not_faster("n", *faster, others=load(HELD_SHARE * 2 - 0.01)).holds
    assert not check_not_faster("n", timing(1.0), timing(5.0), others=load(0.0)).holds
    # The share scales with the cores: 0.3 of 16 cores excuses nothing.
    assert not check_not_faster("n", *faster, others=load(0.3, 16)).holds
    assert check_not_faster("n", timing(1.5), timing(1.0), others=load(0.0)).holds


def test_check_unless_loaded_excuses_a_failed_claim_only_under_a_load():
    quiet = check_unless_loaded("c", False, "2.5×", load(0.1))
    assert quiet.claim == "c, or other programs took 1/8 of the cores"
    assert not quiet.holds
    assert quiet.evidence == "2.5×; other programs: 0.10 of 2 cores"
    loaded = check_unless_loaded("c", False, "2.5×", load(0.25))
    assert loaded.holds and loaded.evidence.endswith("; excused by their load")
    held = check_unless_loaded("c", True, "1.1×", load(1.0))
    assert held.holds and held.evidence == "1.1×; other programs: 1.00 of 2 cores"
