"""Benchmark harness for pytest: one parametrized test per (workload, dtype).

    python -m pytest benchmarks -m gpu [--bench-tier smoke|models] [--bench-models llama]
        [--junitxml out.xml]

Each case records its numbers as JUnit properties; `tileops bench` runs the same cases with
a progress bar and writes the JSON / Markdown / PNG reports.
"""

import dataclasses

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--bench-tier", choices=["smoke", "full", "models"], default="full",
                     help="which workloads to benchmark: the manifest's (smoke, full) or the "
                          "shapes of public models (models, see tileops/perf/models.yaml)")
    parser.addoption("--bench-models", action="append", metavar="TEXT",
                     help="with --bench-tier models: only models whose name contains TEXT")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="benchmarks need a CUDA device")
        for item in items:
            item.add_marker(skip)


@pytest.fixture
def bench(record_property):
    """Runs one case and records every number of its row as a JUnit property."""
    from tileops.perf.bench import bench_workload

    def run(op_cls, workload, dtype):
        row = bench_workload(op_cls, workload, dtype)
        for key, value in dataclasses.asdict(row).items():
            if key == "baselines":
                for name, latency in value.items():
                    record_property(f"baseline_{name}_latency_us", f"{latency:.2f}")
                    record_property(f"baseline_{name}_ratio", f"{latency / row.latency_us:.3f}")
            else:
                record_property(key, f"{value:.3f}" if isinstance(value, float) else value)
        return row

    return run


def pytest_generate_tests(metafunc):
    """Parametrizes a bench module's test over its ops' (`OPS`, or `OP`) manifest workloads."""
    if "workload" not in metafunc.fixturenames:
        return
    from tileops.perf.bench import bench_cases

    tier = metafunc.config.getoption("--bench-tier")
    ops = getattr(metafunc.module, "OPS", None) or [metafunc.module.OP]
    found = list(bench_cases(ops, None if tier == "full" else tier,
                             models=metafunc.config.getoption("--bench-models")))
    if "op_cls" in metafunc.fixturenames:
        metafunc.parametrize("op_cls, workload, dtype", found,
                             ids=[f"{c.__name__} {w['label']} [{d}]" for c, w, d in found])
    else:
        metafunc.parametrize("workload, dtype", [(w, d) for _, w, d in found],
                             ids=[f"{w['label']} [{d}]" for _, w, d in found])
