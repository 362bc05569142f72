"""Online filtering, drop_solved, bucket means and the graded rubric prompt: spec vectors of
docs/algorithms.md §7, §9 and §11 (vector 13) and the vectors of ares-core's filter.rs /
rubric.rs tests."""

import math

import numpy as np
import pytest

import ares

ACC = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0], dtype=np.float64)


# ---------------------------------------------------------------- §7 online filtering


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_filter_keeps_mixed_groups(dtype):
    acc = ACC.astype(dtype)
    means = ares.group_means(acc, n=4)
    assert means.dtype == dtype
    np.testing.assert_array_equal(means, [1.0, 0.0, 0.5, 0.25])
    keep, kept = ares.filter_groups(acc, n=4)
    assert keep.dtype == np.bool_ and kept == 2
    np.testing.assert_array_equal(keep, [False, False, True, True])
    rows, kept_rows = ares.expand_keep(keep, n=4)
    assert kept_rows == 8
    np.testing.assert_array_equal(rows, [False] * 8 + [True] * 8)


def test_filter_bounds_are_strict():
    # means 0.25 and 0.75 sit on the bounds and are dropped
    v = np.array([0.25, 0.25, 0.5, 0.5, 0.75, 0.75])
    keep, kept = ares.filter_groups(v, n=2, filter_low=0.25, filter_high=0.75)
    np.testing.assert_array_equal(keep, [False, True, False])
    assert kept == 1


def test_filter_by_uid_keeps_groups_whole():
    # groups numbered by first appearance: "p1" (rows 0, 2: acc 1, 1), "p0" (rows 1, 3: 1, 0)
    uid = ["p1", "p0", "p1", "p0"]
    acc = np.array([1.0, 1.0, 1.0, 0.0])
    np.testing.assert_array_equal(ares.group_means(acc, uid=uid), [1.0, 0.5])
    keep, kept = ares.filter_groups(acc, uid=uid)
    np.testing.assert_array_equal(keep, [False, True])
    rows, n_rows = ares.expand_keep(keep, uid=uid)
    np.testing.assert_array_equal(rows, [False, True, False, True])
    assert (kept, n_rows) == (1, 2)
    # ragged groups, integer uids
    uid = np.array([7, 7, 7, 3, 3])
    np.testing.assert_allclose(ares.group_means(np.array([1.0, 0.0, 0.0, 1.0, 1.0]), uid=uid), [1 / 3, 1.0])


def test_filter_catches_a_wrong_grouping():
    keep, _ = ares.filter_groups(ACC, n=2)  # pairs: (1,1) (1,1) (0,0) (0,0) (1,0) (1,0) (0,0) (1,0)
    np.testing.assert_array_equal(keep, [False, False, False, False, True, True, False, True])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ares.group_means(np.array([0.0, np.inf, 0.0, 0.0]), n=2), "`values` holds a non-finite value \\(NaN or ±inf\\) at index 1"),
        (lambda: ares.group_means(np.zeros(3), n=2), "`n` = 2 does not fit the batch"),
        (lambda: ares.group_means(np.zeros(4, dtype=np.int64), n=2), "`values` must have dtype float32 or float64"),
        (lambda: ares.filter_groups(np.zeros(4), n=2, filter_low=0.5, filter_high=0.5), "`filter_high`"),
        (lambda: ares.filter_groups(np.zeros(4), n=2, filter_low=np.nan), "`filter_low`"),
        (lambda: ares.filter_groups(np.zeros(4)), "the groups are missing"),
        (lambda: ares.expand_keep(np.array([True]), uid=["a", "a", "b"]), "`keep_groups` has 1 elements, expected 2"),
        (lambda: ares.expand_keep(np.array([1, 0]), n=2), "`keep_groups` must have dtype bool"),
        (lambda: ares.group_means(np.zeros(3), uid=["a", "b"]), "`uid` has 2 elements, expected 3"),
    ],
)
def test_filter_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_drop_solved_streaks():
    s = 0
    for visit in (1, 2, 3):
        s = ares.solved_streak(s, True, 0.1, 0.3)
        assert s == visit
        assert ares.is_solved(s, 3) == (visit == 3)
    assert ares.solved_streak(2, True, 0.3, 0.3) == 0  # not strictly below
    assert ares.solved_streak(2, False, 0.0) == 0
    assert ares.solved_streak(2**32 - 1, True, 0.0) == 2**32 - 1  # saturates
    assert not ares.is_solved(100, 0)
    assert ares.is_solved(3) and not ares.is_solved(2)
    with pytest.raises(ValueError, match="`mean_entropy` holds a non-finite value"):
        ares.solved_streak(0, True, math.nan)
    with pytest.raises(ValueError, match="`entropy_threshold`"):
        ares.solved_streak(0, True, 0.1, math.inf)


def test_bucket_means():
    got = ares.bucket_means(["easy", 0, "hard", np.int64(0)], np.array([1.0, 3.0, 5.0, 2.0], dtype=np.float32))
    assert got == {"easy": 2.0, "medium": None, "hard": 5.0}
    with pytest.raises(ValueError, match="`values` has 2 elements, expected 1"):
        ares.bucket_means(["easy"], np.zeros(2))
    with pytest.raises(ValueError, match="is not a bucket"):
        ares.bucket_means(["tricky"], np.zeros(1))


def test_batch_median_threshold():
    assert ares.batch_median_threshold(np.array([0.5, 9.0, 1.5, 0.7]), np.array([1.0, 0.0, 1.0, 1.0])) == 0.7
    got = ares.batch_median_threshold(np.array([0.5, 1.5], np.float32), np.array([1.0, 1.0], np.float32))
    assert got == 1.0  # even count: the mean of the middle two
    assert ares.batch_median_threshold(np.array([0.5]), np.array([0.0])) is None
    with pytest.raises(ValueError, match="`has_threshold`"):
        ares.batch_median_threshold(np.array([0.5]), np.array([0.5]))
    # the pipeline: window means -> per-response percentile -> m
    h = np.array([[0.2, 1.0, 1.2, 0.8, 0.4, 0.1, 0.0, 0.0]], dtype=np.float32)
    w = ares.entropy_windows(h, np.ones_like(h), window_size=4)
    thr, has = ares.row_percentile(w["means"], w["valid"])
    assert ares.batch_median_threshold(thr, has) == pytest.approx(float(thr[0]))


# ---------------------------------------------------------------- §9 graded rubric prompt


def test_spec_vector_13_linear_ratios_and_counts():
    ratios = [ares.reveal_ratio(k, 8) for k in range(8)]
    np.testing.assert_allclose(ratios, [(7 - k) / 7 for k in range(8)], rtol=0, atol=1e-15)
    counts = [ares.reveal_count(k, 8, 10) for k in range(8)]
    assert [c for c, _ in counts] == [10, 9, 7, 6, 4, 3, 1, 0]
    assert [a for _, a in counts] == [True] + [False] * 7
    assert [ares.reveal_count(k, 5, 5)[0] for k in range(5)] == [5, 4, 2, 1, 0]  # 2.5 -> 2


def test_binary_rule():
    assert [ares.reveal_ratio(k, 5, schedule="binary", full_reveal_count=3) for k in range(5)] == [1, 1, 1, 0, 0]
    assert ares.reveal_count(2, 5, 7, schedule="binary", full_reveal_count=3) == (7, True)
    assert ares.reveal_count(3, 5, 7, schedule="binary", full_reveal_count=3) == (0, False)


def test_step_factors():
    f = lambda sched, step, **kw: ares.step_factor(step, 11, sched, **kw)  # noqa: E731
    assert f("step_linear", 1) == 1.0
    assert f("step_linear", 6) == pytest.approx(0.5, abs=1e-15)
    assert f("step_linear", 11) == 0.0 and f("step_linear", 50) == 0.0 and f("step_linear", 0) == 1.0
    assert f("step_power", 6, power=2.0) == pytest.approx(0.25, abs=1e-15)
    assert f("step_power", 11, power=0.0) == 1.0
    assert f("step_sigmoid", 1) == pytest.approx(0.9525741268, abs=1e-9)
    assert f("step_sigmoid", 4) == pytest.approx(0.5, abs=1e-12)
    assert f("step_sigmoid", 11) == pytest.approx(0.0009110512, abs=1e-9)
    assert ares.step_factor(5, 1, "step_sigmoid") == 1.0  # T <= 1: no decay
    assert ares.step_factor(3, 11, "linear") == 1.0
    # combined: k = 1 of 8 at step 6 of 11: (6/7)·0.5 = 3/7; 10·3/7 = 4.29 -> 4
    kw = dict(step=6, total_steps=11, schedule="step_linear")
    assert ares.reveal_ratio(1, 8, **kw) == pytest.approx(3 / 7, abs=1e-15)
    assert ares.reveal_count(1, 8, 10, **kw) == (4, False)
    assert ares.reveal_count(0, 8, 10, **kw) == (5, False)  # k = 0 under s < 1 is a subset
    assert ares.reveal_count(0, 8, 10, step=1, total_steps=11, schedule="step_linear") == (10, True)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ares.reveal_ratio(0, 1), "`graded_system_prompt` needs at least 2 samples per group, got n = 1"),
        (lambda: ares.reveal_count(8, 8, 10), "k \\(sample index\\)"),
        (lambda: ares.step_factor(1, 5, "step_power", power=-1.0), "`step_power_n`"),
        (lambda: ares.step_factor(1, 5, "step_sigmoid", start_point=math.nan), "`step_sigmoid_start_point`"),
        (lambda: ares.reveal_ratio(0, 4, schedule="cosine"), '`schedule` = "cosine" is not one of'),
        (lambda: ares.select_criteria(5, 4, 0), "`count \\(criteria shown\\)` = 5"),
    ],
)
def test_rubric_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_select_criteria():
    assert ares.select_criteria(0, 4, 1) == []
    assert ares.select_criteria(3, 4, 1, all=True) == [0, 1, 2, 3]  # all: original order
    a = ares.select_criteria(3, 10, 42)
    assert a == ares.select_criteria(3, 10, 42)  # the seed decides
    assert len(set(a)) == 3 and all(0 <= i < 10 for i in a)
    assert any(ares.select_criteria(3, 10, s) != a for s in range(1, 5))
    # uniform over ordered picks: 2 of 3, 6 outcomes, 6000 seeds
    hist = {}
    for seed in range(6000):
        pick = tuple(ares.select_criteria(2, 3, seed))
        hist[pick] = hist.get(pick, 0) + 1
    assert len(hist) == 6 and all(850 < h < 1150 for h in hist.values()), hist


CRITERIA = [
    ("Identifies the symptoms", 8.0),
    ("Suggests a prescription drug", -2.0),
    ("Mentions the weather", 0.0),
    ("Gives self-care advice", 2.5),
    ("Recommends surgery", -10.0),
]


def test_rubric_message_layout():
    got = ares.rubric_message(CRITERIA, [3, 1, 2, 0, 4])
    want = (
        f"{ares.RUBRIC_INTRO}\n\n"
        f"{ares.RUBRIC_INCLUDE_HEADER}\n"
        "Criterion 1: Gives self-care advice (worth 2.5 points)\n"
        "Criterion 2: Identifies the symptoms (worth 8 points)\n\n"
        f"{ares.RUBRIC_AVOID_HEADER}\n"
        "Criterion 1: Suggests a prescription drug (penalty: 2 points)\n"
        "Criterion 2: Recommends surgery (penalty: 10 points)\n\n"
        f"{ares.RUBRIC_CLOSING}\n\n"
        f"{ares.RUBRIC_HIDE_INSTRUCTION}"
    )
    assert got == want
    assert ares.RUBRIC_INCLUDE_HEADER.startswith("IMPORTANT POINTS TO INCLUDE")
    got = ares.rubric_message(CRITERIA, [1], hide_instruction=False)
    assert got == (
        f"{ares.RUBRIC_INTRO}\n\n{ares.RUBRIC_AVOID_HEADER}\n"
        f"Criterion 1: Suggests a prescription drug (penalty: 2 points)\n\n{ares.RUBRIC_CLOSING}\n\n"
    )
    assert ares.rubric_message(CRITERIA, [0], intro="Hi.", hide_instruction=False).startswith("Hi.\n\n")


def test_rubric_message_without_criteria():
    assert ares.rubric_message(CRITERIA, []) is None
    assert ares.rubric_message(CRITERIA, [2]) is None  # only a zero-point criterion
    assert ares.rubric_message(CRITERIA, [], add_base_when_zero=True) == ares.RUBRIC_BASE == "You are a helpful assistant."


def test_rubric_message_errors():
    with pytest.raises(ValueError, match="`shown`.*position 1.*5"):
        ares.rubric_message(CRITERIA, [0, 5])
    with pytest.raises(ValueError, match="`shown`"):
        ares.rubric_message(CRITERIA, [0, 3, 0])
    with pytest.raises(ValueError, match="`criteria points` holds a non-finite value \\(NaN or ±inf\\) at index 1"):
        ares.rubric_message([("a", 1.0), ("b", math.nan)], [1])
    with pytest.raises(ValueError, match="`criteria` must be a sequence of"):
        ares.rubric_message([("a",)], [0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rubric_score(dtype):
    assert ares.rubric_score(np.array([8, 6, -2], dtype=dtype), np.array([True, False, True])) == pytest.approx(
        6 / 14, rel=1e-7
    )
    assert ares.rubric_score([8.0, 6.0], [True, True]) == 1.0
    assert ares.rubric_score([8.0, -6.0], [False, True]) == -0.75
    assert ares.rubric_score([8.0, 6.0, -2.0], [False, False, False]) == 0.0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ares.rubric_score([0.0, -1.0], [True, True]), "`total positive points`"),
        (lambda: ares.rubric_score([1.0], [True, False]), "`met` has 2 elements, expected 1"),
        (lambda: ares.rubric_score([1.0, math.inf], [True, False]), "`points` holds a non-finite value \\(NaN or ±inf\\) at index 1"),
        (lambda: ares.rubric_score(np.array([1.0]), np.array([1])), "`met` must have dtype bool"),
        (lambda: ares.rubric_score(np.array([1], dtype=np.int64), [True]), "`points` must have dtype float32 or float64"),
    ],
)
def test_rubric_score_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
