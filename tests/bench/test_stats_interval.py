import math

from chatfleet.bench.stats import confidence_interval


def test_a_t_interval_on_few_repeats_reaches_below_zero_unless_told_the_range():
    values = [0.1, 1.9]  # two repeats far apart: the t half-width (12.7 * sd / sqrt 2) is huge
    free = confidence_interval(values)
    assert free.low < 0  # the oracle: the plain formula goes negative here
    cut = confidence_interval(values, within=(0.0, math.inf))
    assert cut.low == 0.0 and cut.high == free.high and cut.mean == free.mean


def test_a_share_is_cut_at_one_and_a_narrow_interval_is_left_alone():
    assert confidence_interval([0.5, 0.99], within=(0.0, 1.0)).high == 1.0
    narrow = confidence_interval([0.50, 0.51, 0.49, 0.50], within=(0.0, 1.0))
    assert narrow == confidence_interval([0.50, 0.51, 0.49, 0.50])
