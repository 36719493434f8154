"""How an op and its baselines share one measurement (CPU: trials stubbed)."""

import pytest

from tileops.perf import timing


def stub_trials(monkeypatch, trial):
    """Replaces the device trials with `trial(fn, reps)`: one by one, and a CUPTI round as
    one trial of each candidate in order (what the profiler session does)."""
    monkeypatch.setattr(timing, "_cupti_trial", trial)
    monkeypatch.setattr(timing, "_events_trial", trial)
    monkeypatch.setattr(timing, "_cupti_round",
                        lambda fns, reps: {name: trial(fn, reps) for name, fn in fns.items()})
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)


@pytest.fixture
def recorded(monkeypatch):
    """Trials that record which candidate ran and return its fixed cost; no device."""
    order = []

    def trial(fn, reps):
        order.append(fn.name)
        return fn.ms

    stub_trials(monkeypatch, trial)
    return order


class Candidate:
    def __init__(self, name, ms, fails=False):
        self.name, self.ms, self.fails, self.calls = name, ms, fails, 0

    def __call__(self):
        self.calls += 1
        if self.fails:
            raise RuntimeError(f"{self.name} cannot run")


def test_trials_alternate_between_candidates(recorded):
    op, base = Candidate("op", 2.0), Candidate("base", 3.0)
    result = timing.measure_together({"op": op, "base": base}, warmup=2, trials=3)
    assert recorded == ["op", "base"] * 3
    assert result["op"].median_ms == 2.0 and result["base"].median_ms == 3.0
    assert result["op"].method == "cupti"
    assert op.calls == base.calls == 2  # warmup only: the stubbed trials call nothing


def test_a_failing_candidate_gets_its_error_and_the_others_still_run(recorded):
    op, broken = Candidate("op", 1.0), Candidate("broken", 1.0, fails=True)
    result = timing.measure_together({"op": op, "broken": broken}, warmup=1, trials=2)
    assert isinstance(result["broken"], RuntimeError)
    assert recorded == ["op", "op"]
    assert result["op"].median_ms == 1.0
    with pytest.raises(RuntimeError, match="broken cannot run"):
        timing.measure(broken, warmup=1)


def test_warmup_lasts_the_requested_time(recorded):
    slow = Candidate("slow", 1.0)
    timing.measure_together({"slow": slow}, warmup=1, trials=1, warm_seconds=0.05)
    assert slow.calls > 1  # kept calling until 50 ms had passed


def test_one_profiler_session_times_a_round_of_every_candidate(recorded, monkeypatch):
    rounds = []
    monkeypatch.setattr(timing, "_cupti_round",
                        lambda fns, reps: rounds.append(list(fns)) or {"op": 2.0, "base": 3.0})
    result = timing.measure_together({"op": Candidate("op", 0), "base": Candidate("base", 0)},
                                     warmup=1, trials=3)
    assert rounds == [["op", "base"]] * 3 and recorded == []  # never one by one
    assert result["op"].median_ms == 2.0 and result["base"].median_ms == 3.0


@pytest.mark.parametrize("round_result", [None, {"op": 2.0, "base": None}, RuntimeError])
def test_a_round_that_cannot_stand_is_timed_one_by_one(recorded, monkeypatch, round_result):
    """No projection, an empty bracket or a candidate that raised mid-round: that round's
    trials run one candidate at a time, so each result (or error) finds its owner."""
    def cupti_round(fns, reps):
        if round_result is RuntimeError:
            raise RuntimeError("base cannot run")
        return round_result

    monkeypatch.setattr(timing, "_cupti_round", cupti_round)
    result = timing.measure_together({"op": Candidate("op", 2.0), "base": Candidate("base", 3.0)},
                                     warmup=1, trials=2)
    assert recorded == ["op", "base"] * 2
    assert result["op"].median_ms == 2.0 and result["base"].median_ms == 3.0


def test_events_fallback_when_the_trace_does_not_project(recorded, monkeypatch):
    profiled = []
    monkeypatch.setattr(timing, "_cupti_trial", lambda fn, reps: profiled.append(1))
    monkeypatch.setattr(timing, "_cupti_round", lambda fns, reps: profiled.append(1))
    result = timing.measure_together({"op": Candidate("op", 4.0)}, warmup=1, trials=3)
    assert result["op"].median_ms == 4.0
    assert result["op"].method == "cuda-events (no kernel time in the trace)"
    assert len(profiled) == 2  # one round, one lone trial; then no more profiler sessions


class Wandering(Candidate):
    """Trial medians that follow a script (a clock that wanders, then settles)."""

    def __init__(self, name, script):
        super().__init__(name, script[0])
        self.script = iter(script)


@pytest.fixture
def scripted(monkeypatch):
    order = []

    def trial(fn, reps):
        order.append(fn.name)
        return next(fn.script) if isinstance(fn, Wandering) else fn.ms

    stub_trials(monkeypatch, trial)
    return order


def test_steady_cases_stop_at_the_minimum_trials(scripted):
    result = timing.measure_together({"op": Candidate("op", 1.0)}, warmup=1, trials=5,
                                     max_trials=15)
    assert scripted == ["op"] * 5 and result["op"].median_ms == 1.0


def test_noisy_cases_take_more_trials_all_candidates_alike(scripted):
    noisy = Wandering("op", [1.0, 1.2, 1.0, 1.2, 1.0] + [1.1] * 20)
    base = Candidate("base", 2.0)
    result = timing.measure_together({"op": noisy, "base": base}, warmup=1, trials=5,
                                     max_trials=8)
    assert scripted == ["op", "base"] * 8  # still interleaved, capped at max_trials
    assert len(result["op"].trials_ms) == len(result["base"].trials_ms) == 8
    assert result["op"].median_ms == pytest.approx(1.1)


def test_past_the_minimum_only_the_op_and_the_best_baseline_go_on(scripted):
    noisy = Wandering("op", [1.0, 1.2] * 10)
    fast_base, slow_base = Candidate("fast", 1.1), Candidate("slow", 5.0)
    result = timing.measure_together({"op": noisy, "slow": slow_base, "fast": fast_base},
                                     warmup=1, trials=5, max_trials=9, focus="op")
    assert scripted == ["op", "slow", "fast"] * 5 + ["op", "fast"] * 4
    assert len(result["slow"].trials_ms) == 5 and len(result["fast"].trials_ms) == 9


def test_many_noisy_trials_settle_once_their_median_is_pinned_down(scripted):
    # two clock states 10% apart, alternating: the spread never shrinks, but the confidence
    # interval of the median falls inside +-1% once enough trials sit on one side of it
    noisy = Wandering("op", [1.0, 1.0, 1.1] * 20)
    result = timing.measure_together({"op": noisy}, warmup=1, trials=5, max_trials=60)
    assert 5 < len(result["op"].trials_ms) < 60
    assert result["op"].median_ms == 1.0


@pytest.mark.parametrize("trials, halfwidth", [
    ([1.0, 1.02, 1.01, 1.0, 1.0], 1.0),  # five trials: half their spread
    ([1.0] * 10 + [2.0] * 10, 50 * 1.0 / 1.5),  # an even split: the interval spans both
    ([1.0] * 30 + [2.0] * 15, 0.0),  # two thirds at one value: the median is pinned there
])
def test_median_confidence_halfwidth(trials, halfwidth):
    assert timing._median_halfwidth_pct(trials) == pytest.approx(halfwidth)
