"""How an op and its baselines share one measurement (CPU: trials stubbed)."""

import pytest

from tileops.perf import timing


@pytest.fixture
def recorded(monkeypatch):
    """Trials that record which candidate ran and return its fixed cost; no device."""
    order = []

    def trial(fn, reps):
        order.append(fn.name)
        return fn.ms

    monkeypatch.setattr(timing, "_cupti_trial", trial)
    monkeypatch.setattr(timing, "_events_trial", trial)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
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


def test_events_fallback_when_the_trace_does_not_project(recorded, monkeypatch):
    monkeypatch.setattr(timing, "_cupti_trial", lambda fn, reps: None)
    result = timing.measure_together({"op": Candidate("op", 4.0)}, warmup=1, trials=3)
    assert result["op"].median_ms == 4.0
    assert result["op"].method.startswith("cuda-events")


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

    monkeypatch.setattr(timing, "_cupti_trial", trial)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
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
