"""GEMM config selection, as data: which config each GEMM call shape selects.

    python3 scripts/gemm_selection.py table [--models TEXT ...]   # models tier: picks vs frozen
    python3 scripts/gemm_selection.py agreement                   # model vs the tuned table
    python3 scripts/gemm_selection.py freeze [--manifest]         # rewrite the frozen picks
    python3 scripts/gemm_selection.py measure [--workload TEXT ...] [--models TEXT ...]
        # on the GPU: the models-tier shapes whose config changed, old config vs new config
        # vs cuBLAS in one process (both compiled in parallel first), no branch switch
    python3 scripts/gemm_selection.py measure --variant '{"full_row": true}' [--variant ...]
        # the model's pick against the same config with fields replaced (--every N: a sample)
    python3 scripts/gemm_selection.py fit [MEASURED.md]
        # the model against a `measure` result: |log(estimate / measured)| per M, and for
        # each shape whether the model now picks the measured old or new config or a third

`freeze` records, for every manifest workload of the ops built on GemmKernel (and its fp8
subclass), every dtype and every GEMM the op launches, the config the current code selects
(tuned table for h200, else the default), plus the models tier's GemmFwdOp picks. The
manifest file backs tests/ops/test_gemm_select_cpu.py (tuned shapes keep their configs);
the models file is the "before" column of `table`. `freeze` rewrites the models file; the
manifest file only with --manifest (it is the baseline the tuned shapes must keep).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MANIFEST_FROZEN = ROOT / "tests" / "ops" / "data" / "gemm_selection_manifest.json"
MODELS_FROZEN = ROOT / "tests" / "ops" / "data" / "gemm_selection_models.json"


def gemm_ops() -> dict[str, type]:
    from tileops.kernels.gemm import GemmKernel
    from tileops.ops import OP_CLASSES

    return {name: cls for name, cls in sorted(OP_CLASSES.items())
            if any(isinstance(k, type) and issubclass(k, GemmKernel)
                   for k in cls.kernel_map.values())}


def selections(op_name: str, cls: type, workloads: list[dict], gpu: str | None = "h200"
               ) -> list[dict]:
    """One record per (workload, dtype, GEMM launched): key, runtime size, bucket, config."""
    from tileops.kernels.base import tuned_table
    from tileops.kernels.gemm import GemmKernel

    spec = cls.spec
    out = []
    for workload in workloads:
        for dtype in workload["dtypes"]:
            op = cls(**spec.workload_params(workload))
            tensors = spec.workload_tensors(workload, dtype)
            ns = op.check([tensors[n] for n in spec.input_names])
            for dispatch_key, key, size in op.kernels_for(ns):
                kernel_cls = op.kernel_map[dispatch_key]
                if not issubclass(kernel_cls, GemmKernel):
                    continue
                kernel = kernel_cls(gpu=gpu, **key)
                bucket = kernel.bucket_of(size)
                config = kernel.config_for(bucket)
                tuned = gpu is not None and tuned_table(gpu).get(
                    kernel.key_string(bucket)) is not None
                out.append({"op": op_name, "label": workload["label"], "dtype": dtype,
                            "tuned": tuned,
                            "kernel": kernel_cls.__name__, "key": key, "size": size,
                            "bucket": bucket, "config": dataclasses.asdict(config)})
    return out


def manifest_selections() -> list[dict]:
    from tileops.manifest import load_workloads

    return [r for name, cls in gemm_ops().items()
            for r in selections(name, cls, load_workloads(name, None))]


def models_selections(models: list[str] | None = None) -> list[dict]:
    from tileops.ops import OP_CLASSES
    from tileops.perf import models as model_shapes

    accepted, _ = model_shapes.split_refused(
        OP_CLASSES["GemmFwdOp"], model_shapes.model_workloads("GemmFwdOp", models))
    for w in accepted:
        w["dtypes"] = ["bfloat16"]
    return selections("GemmFwdOp", OP_CLASSES["GemmFwdOp"], accepted)


# (rows frozen before wave_fill and full_row were recorded hold the first eight)
CONFIG_FIELDS = ("block_m", "block_n", "block_k", "stages", "threads", "split_k", "raster",
                 "stage_out", "wave_fill", "full_row")


def compact(r: dict) -> list:
    """A models-tier record as [label, M, N, K, config values] (bf16, Linear layout)."""
    return [r["label"], r["size"], r["key"]["n"], r["key"]["k"],
            [r["config"][f] for f in CONFIG_FIELDS]]


def record_key(r: dict) -> str:
    return json.dumps([r["op"], r["label"], r["dtype"], r["key"], r["size"]], sort_keys=True)


def short(config: dict) -> str:
    c = config
    text = f"{c['block_m']}x{c['block_n']}x{c['block_k']} s{c['stages']} t{c['threads']}"
    text += f" r{c['raster']}"
    if c["split_k"] > 1:
        text += f" split{c['split_k']}"
    if not c.get("stage_out", True):
        text += " regs-out"
    if c.get("wave_fill"):
        text += " wave-fill"
    if c.get("full_row"):
        text += " full-row"
    if c.get("async_mma"):
        text += " async"
    if c.get("pingpong"):
        text += " pingpong"
    elif c.get("persistent"):
        text += " persistent"
    return text


def cmd_freeze(args: argparse.Namespace) -> int:
    MODELS_FROZEN.parent.mkdir(parents=True, exist_ok=True)
    rows = [compact(r) for r in models_selections()]
    MODELS_FROZEN.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    print(f"wrote {MODELS_FROZEN}")
    if args.manifest:
        MANIFEST_FROZEN.write_text(json.dumps(manifest_selections(), indent=1, sort_keys=True)
                                   + "\n")
        print(f"wrote {MANIFEST_FROZEN}")
    return 0


def cmd_table(args: argparse.Namespace) -> int:
    from tileops.kernels.gemm import select

    before = {tuple(r[:4]): dict(zip(CONFIG_FIELDS, r[4], strict=False))
              for r in json.loads(MODELS_FROZEN.read_text())}
    rows = models_selections(args.models)
    changed = 0
    ratios: dict[int, list[float]] = {}
    print("| workload | M | N | K | bucket | before (frozen) | model pick | est. us before | "
          "est. us pick | source |")
    print("|---|--:|--:|--:|---|---|---|--:|--:|---|")
    for r in rows:
        key, m = r["key"], r["size"]
        old_config = before.get((r["label"], m, key["n"], key["k"]))
        old = {"config": old_config} if old_config else None
        shape = select.Shape(m=m, n=key["n"], k=key["k"], dtype=key["dtype"])
        est_new = select.estimate_us(shape, select.as_config(r["config"]))
        est_old = select.estimate_us(shape, select.as_config(old["config"])) if old else None
        same = old is not None and {"wave_fill": False, "full_row": False,
                                    **old["config"]} == {f: r["config"][f]
                                                         for f in CONFIG_FIELDS}
        changed += not same
        if est_old is not None:
            ratios.setdefault(m, []).append(est_old / est_new)
        print(f"| {r['label']} | {m} | {key['n']} | {key['k']} | {r['bucket']} | "
              f"{short(old['config']) if old else '-'} | {short(r['config'])}"
              f"{'' if same else ' *'} | {est_old if est_old is None else f'{est_old:.1f}'} | "
              f"{est_new:.1f} | {select.source_of(r['key'], r['bucket'])} |")
    print(f"\n{len(rows)} shapes, {changed} with a new config (*)")
    print("\nmodel's estimated speed-up of the new picks over the old, per token count "
          "(geometric mean, worst, best):")
    for m, values in sorted(ratios.items()):
        geo = math.exp(sum(math.log(v) for v in values) / len(values))
        print(f"  M={m}: {geo:.3f}x, {min(values):.3f}x .. {max(values):.3f}x "
              f"over {len(values)} shapes")
    return 0


def wave_fill_cases(r: dict) -> list[tuple]:
    """(record, the model's best config without wave fill, its pick) where it picks a
    wave fill (`select.candidates` lists those last; they must win by TIE)."""
    from tileops.kernels.gemm import GemmConfig, GemmKernel, select

    pick = GemmConfig(**r["config"])
    if not pick.wave_fill:
        return []
    kernel = GemmKernel(gpu="h200", **r["key"])
    plain = select.choose(kernel.model_shape(), kernel.bucket_rows(r["bucket"]), "h200",
                          wave_fill=False)
    return [(r, plain, pick)]


def variant_cases(r: dict, variants: list[dict]) -> list[tuple]:
    """(record, its pick, the pick with each variant's fields replaced: None where that is
    the pick itself or not a valid config) where some variant is another valid config."""
    from tileops.kernels.gemm import GemmConfig

    pick = GemmConfig(**r["config"])
    out = [dataclasses.replace(pick, **fields) for fields in variants]
    out = [v if v != pick and v.valid() else None for v in out]
    return [(r, pick, *out)] if any(out) else []


def shape_records(shapes: list[str]) -> list[dict]:
    """Records for explicit MxNxK shapes (bf16; b [N, K] as a Linear weight, or [K, N] with
    a ':kn' suffix), as the model picks them."""
    from tileops.kernels.gemm import GemmKernel

    out = []
    for text in shapes:
        dims, _, layout = text.lower().partition(":")
        m, n, k = (int(v) for v in dims.split("x"))
        key = {"dtype": "bfloat16", "n": n, "k": k, "trans_a": False,
               "trans_b": layout != "kn"}
        kernel = GemmKernel(gpu="h200", **key)
        bucket = kernel.bucket_of(m)
        out.append({"label": text, "key": key, "size": m, "bucket": bucket,
                    "config": dataclasses.asdict(kernel.config_for(bucket))})
    return out


def whole_tiles(kernel, config, bucket: str, a, b, d):
    """A launch of the wave-fill program with every tile whole (no pieces, no merge)."""
    from tileops.kernels.base import sm_count
    from tileops.kernels.gemm.wave_fill import merge_buffers

    launch = kernel.use(config, bucket)[1][0]
    slots, counts = merge_buffers(d.device, config.block_m, config.block_n,
                                  sm_count(d.device))
    tiles = -(-d.shape[0] // config.block_m) * -(-d.shape[1] // config.block_n)
    return lambda: launch(a, b, d, slots, counts, tiles, 1)


def cmd_measure(args: argparse.Namespace) -> int:
    """Old vs new config of every changed models-tier shape, timed side by side with cuBLAS.

    The kernel code of the old configs is unchanged, so pinning them (`Kernel.use`) runs
    exactly what the previous selection ran."""
    import os

    from tileops.kernels.gemm import GemmConfig, GemmKernel
    from tileops.perf.timing import measure_together

    before = {tuple(r[:4]): GemmConfig(**dict(zip(CONFIG_FIELDS, r[4], strict=False)))
              for r in json.loads(MODELS_FROZEN.read_text())}
    cases = []
    records = shape_records(args.shape) if args.shape else models_selections(args.models)
    for r in records:
        if args.workload and not any(t in r["label"] for t in args.workload):
            continue
        if args.wave_fill:
            cases += wave_fill_cases(r)
            continue
        if args.variant:
            cases += variant_cases(r, [json.loads(v) for v in args.variant])
            continue
        old = before.get((r["label"], r["size"], r["key"]["n"], r["key"]["k"]))
        new = GemmConfig(**r["config"])
        if old is not None and old != new:
            cases.append((r, old, new))
    cases = cases[::args.every]
    print(f"{len(cases)} changed shapes; compiling their old and new configs", flush=True)
    kernels = {}
    jobs = []
    for r, *configs in cases:
        kernel = kernels.setdefault(json.dumps(r["key"], sort_keys=True),
                                    GemmKernel(gpu="h200", **r["key"]))
        jobs += [(kernel, config, r["bucket"]) for config in configs if config is not None]
    from concurrent.futures import ThreadPoolExecutor

    def build(job):
        kernel, config, bucket = job
        try:
            kernel.compile(config, bucket)
        except Exception as e:  # noqa: BLE001 - reported with the case
            print(f"compile failed: {kernel.key} {bucket} {config}: {e}", flush=True)

    with ThreadPoolExecutor(args.jobs or os.cpu_count() or 1) as pool:
        list(pool.map(build, jobs))
    if args.compile_only:
        return 0
    if args.variant:
        return measure_variants(cases, kernels, args)
    print("| workload | M | N | K | old config | new config | old us | new us | cuBLAS us | "
          "new/old speed-up | new vs cuBLAS | old vs cuBLAS |")
    print("|---|--:|--:|--:|---|---|--:|--:|--:|--:|--:|--:|")
    gains, new_vs, old_vs = [], [], []
    for r, old, new in cases:
        key, m = r["key"], r["size"]
        ours, cublas = case_runners(r, kernels)
        timed = {"old": ours(old), "new": ours(new), "cublas": cublas}
        if new.wave_fill:  # the same program with no pieces: what the fill itself costs
            timed["whole"] = whole_tiles(ours.kernel, new, r["bucket"], *ours.tensors)
        try:
            t = measure_together(timed)
            old_us, new_us, ref_us = (t[n].median_ms * 1e3 for n in ("old", "new", "cublas"))
            if args.cublas_kernels:
                print_cublas_kernels(r, cublas)
            if "whole" in t:
                print(f"  {r['label']} M={m}: wave-fill program, every tile whole: "
                      f"{t['whole'].median_ms * 1e3:.1f} us", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing case must not stop the sweep
            print(f"| {r['label']} | {m} | {key['n']} | {key['k']} | {short(asdict_(old))} | "
                  f"{short(asdict_(new))} | error: {type(e).__name__}: {e} |||||||", flush=True)
            continue
        gains.append(old_us / new_us)
        new_vs.append(ref_us / new_us)
        old_vs.append(ref_us / old_us)
        print(f"| {r['label']} | {m} | {key['n']} | {key['k']} | {short(asdict_(old))} | "
              f"{short(asdict_(new))} | {old_us:.1f} | {new_us:.1f} | {ref_us:.1f} | "
              f"{gains[-1]:.3f}x | {new_vs[-1]:.3f}x | {old_vs[-1]:.3f}x |", flush=True)
    if gains:
        print(f"\n{len(gains)} shapes: new/old geomean {geo(gains):.3f}x (worst "
              f"{min(gains):.3f}x, best {max(gains):.3f}x); vs cuBLAS: new {geo(new_vs):.3f}x "
              f"(worst {min(new_vs):.3f}x), old {geo(old_vs):.3f}x (worst {min(old_vs):.3f}x)")
    return 0


def geo(values: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in values) / len(values))


def case_runners(r: dict, kernels: dict):
    """For one record: ours(config) -> a launch of that config pinned on fresh random
    inputs (ours.kernel, ours.tensors = (a, b, d)), and the cuBLAS call on the same."""
    import torch

    key, m = r["key"], r["size"]
    kernel = kernels[json.dumps(key, sort_keys=True)]
    dtype = getattr(torch, key["dtype"])
    a = torch.randn(m, key["k"], device="cuda").to(dtype)
    b = (torch.randn(key["n"], key["k"], device="cuda") * key["k"] ** -0.5).to(dtype)
    if not key["trans_b"]:
        b = b.t().contiguous()  # [K, N]
    d = torch.empty(m, key["n"], device="cuda", dtype=dtype)

    def ours(config):
        compiled = kernel.use(config, r["bucket"])[1]
        return lambda: kernel.run(config, compiled, a, b, d)
    ours.kernel, ours.tensors = kernel, (a, b, d)
    return ours, lambda: torch.matmul(a, b.t() if key["trans_b"] else b)


def print_cublas_kernels(r: dict, cublas) -> None:
    from tileops.perf.timing import kernel_breakdown

    names = ", ".join(f"{name} ({us:.1f} us)" for name, us in kernel_breakdown(cublas))
    print(f"  {r['label']} M={r['size']}: cuBLAS runs {names}", flush=True)


def measure_variants(cases: list[tuple], kernels: dict, args: argparse.Namespace) -> int:
    """The model's pick against each --variant of it, side by side with cuBLAS."""
    from tileops.perf.timing import measure_together

    names = [f"v{i + 1}" for i in range(len(args.variant))]
    for name, text in zip(names, args.variant, strict=True):
        print(f"{name} = the pick with {text}")
    print("| workload | M | N | K | pick | pick us | " + " | ".join(f"{n} us" for n in names)
          + " | cuBLAS us | " + " | ".join(f"{n}/pick" for n in names)
          + " | pick vs cuBLAS | best vs cuBLAS |")
    print("|---|--:|--:|--:|---|" + "--:|" * (2 * len(names) + 4))
    gains: dict[str, list[float]] = {n: [] for n in names}
    pick_vs, best_vs = [], []
    for r, pick, *variants in cases:
        key, m = r["key"], r["size"]
        ours, cublas = case_runners(r, kernels)
        timed = {"pick": ours(pick), **{n: ours(v) for n, v in zip(names, variants,
                                                                   strict=True) if v},
                 "cublas": cublas}
        try:
            t = measure_together(timed)
            us = {n: t[n].median_ms * 1e3 for n in timed}
            if args.cublas_kernels:
                print_cublas_kernels(r, cublas)
        except Exception as e:  # noqa: BLE001 - one failing case must not stop the sweep
            print(f"| {r['label']} | {m} | {key['n']} | {key['k']} | {short(asdict_(pick))} | "
                  f"error: {type(e).__name__}: {e} |", flush=True)
            continue
        for n in names:
            if n in us:
                gains[n].append(us["pick"] / us[n])
        best = min(us[n] for n in ["pick", *names] if n in us)
        pick_vs.append(us["cublas"] / us["pick"])
        best_vs.append(us["cublas"] / best)
        print(f"| {r['label']} | {m} | {key['n']} | {key['k']} | {short(asdict_(pick))} | "
              f"{us['pick']:.1f} | " + " | ".join(f"{us[n]:.1f}" if n in us else "-"
                                                  for n in names)
              + f" | {us['cublas']:.1f} | "
              + " | ".join(f"{us['pick'] / us[n]:.3f}x" if n in us else "-" for n in names)
              + f" | {pick_vs[-1]:.3f}x | {best_vs[-1]:.3f}x |", flush=True)
    if pick_vs:
        print(f"\n{len(pick_vs)} shapes; vs cuBLAS: pick {geo(pick_vs):.3f}x (worst "
              f"{min(pick_vs):.3f}x), best of all {geo(best_vs):.3f}x (worst {min(best_vs):.3f}x)")
        for n in (n for n in names if gains[n]):
            print(f"  {n}/pick over {len(gains[n])}: geomean {geo(gains[n]):.3f}x, "
                  f"worst {min(gains[n]):.3f}x, best {max(gains[n]):.3f}x")
    return 0


def measured_rows(path: pathlib.Path) -> list[dict]:
    """The rows of a `measure` result: label, M, N, K, old and new config, their times."""
    import re

    from tileops.kernels.gemm import GemmConfig

    def parse(text: str) -> GemmConfig | None:
        """`short()`'s text back into a config (None: not a config)."""
        found = re.fullmatch(r"(\d+)x(\d+)x(\d+) s(\d+) t(\d+) r(\d+)(?: split(\d+))?"
                             r"( regs-out)?( wave-fill)?( full-row)?", text)
        if found is None:
            return None
        bm, bn, bk, st, th, ra, sp, regs, fill, row = found.groups()
        return GemmConfig(int(bm), int(bn), int(bk), int(st), int(th), int(sp or 1), int(ra),
                          stage_out=not regs, wave_fill=bool(fill), full_row=bool(row))

    out = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # old vs new rows only (a --variant table's fifth column is a time)
        if len(cells) == 12 and cells[1].isdigit() and parse(cells[5]) is not None:
            out.append({"label": cells[0], "m": int(cells[1]), "n": int(cells[2]),
                        "k": int(cells[3]), "old": parse(cells[4]), "new": parse(cells[5]),
                        "old_us": float(cells[6]), "new_us": float(cells[7])})
    return out


def cmd_fit(args: argparse.Namespace) -> int:
    from statistics import median

    from tileops.kernels.gemm import select

    rows = measured_rows(pathlib.Path(args.measured))
    errors: dict[int, list[float]] = {}
    for r in rows:
        shape = select.Shape(r["m"], r["n"], r["k"])
        for config, us in ((r["old"], r["old_us"]), (r["new"], r["new_us"])):
            errors.setdefault(r["m"], []).append(
                abs(math.log(select.estimate_us(shape, config) / us)))
    print("|log(estimate / measured)| per M: median, worst (points)")
    for m, e in sorted(errors.items()):
        print(f"  M={m}: {median(e):.3f}, {max(e):.3f} ({len(e)})")
    every = [x for e in errors.values() for x in e]
    print(f"  all: {median(every):.3f}, {max(every):.3f} ({len(every)})")
    kept, third = [], []
    for r in rows:
        pick = select.choose(select.Shape(0, r["n"], r["k"]), r["m"])
        best = min(r["old_us"], r["new_us"])
        if pick in (r["old"], r["new"]):
            us = r["old_us"] if pick == r["old"] else r["new_us"]
            kept.append((us / best, r["old_us"] / us, r, "old" if pick == r["old"] else "new"))
        else:
            third.append((r, pick))
    print(f"\n{len(kept)} shapes pick a measured config "
          f"({sum(w == 'old' for *_, w in kept)} the old, {sum(w == 'new' for *_, w in kept)} "
          f"the new), {len(third)} a third one")
    if kept:
        geo = math.exp(sum(math.log(x) for x, *_ in kept) / len(kept))
        print(f"  measured pick / better of the two: geomean {geo:.4f}x, worst "
              f"{max(x for x, *_ in kept):.3f}x; speed-up over old: worst "
              f"{min(g for _, g, *_ in kept):.3f}x")
    for ratio, _, r, which in sorted(kept, key=lambda x: -x[0]):
        if ratio > 1.0:
            print(f"  {r['label']} (M {r['m']}): picks the {which} config, {ratio:.3f}x the better")
    for r, pick in third:
        print(f"  {r['label']} (M {r['m']}): third config {short(asdict_(pick))}")
    return 0


def asdict_(config) -> dict:
    return dataclasses.asdict(config)


def cmd_agreement(_: argparse.Namespace) -> int:
    from tileops.kernels.gemm import select

    rows = select.agreement()
    for entry, tuned, pick in rows:
        verdict = "same" if tuned == pick else "tile" if select.same_tile(tuned, pick) else "DIFF"
        print(f"{verdict}  {entry}\n      tuned {short(dataclasses.asdict(tuned))}  "
              f"model {short(dataclasses.asdict(pick))}")
    tile = sum(select.same_tile(t, p) for _, t, p in rows)
    full = sum(t == p for _, t, p in rows)
    total = len(rows)
    print(f"\nmodel vs tuned table: tile and split agree on {tile}/{total}, "
          f"the whole config on {full}/{total}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    freeze = sub.add_parser("freeze")
    # the manifest file is the pre-model baseline test_gemm_select_cpu.py checks against:
    # rewrite it only when a tuned table's picks are meant to change
    freeze.add_argument("--manifest", action="store_true",
                        help="also rewrite the manifest workloads' frozen picks")
    freeze.set_defaults(fn=cmd_freeze)
    sub.add_parser("agreement").set_defaults(fn=cmd_agreement)
    measure = sub.add_parser("measure")
    measure.add_argument("--models", action="append", help="only models whose name contains TEXT")
    measure.add_argument("--workload", action="append",
                         help="only workloads whose label contains TEXT, e.g. '4096 tokens'")
    measure.add_argument("--jobs", type=int, default=0, help="parallel compiles (CPU count)")
    measure.add_argument("--wave-fill", action="store_true",
                         help="where the model picks a wave fill (wave_fill.py): old = its "
                              "best pick without one, new = the wave fill")
    measure.add_argument("--variant", metavar="JSON", action="append",
                         help="old = the model's pick, new = the pick with these config "
                              "fields replaced, e.g. '{\"full_row\": true}'")
    measure.add_argument("--cublas-kernels", action="store_true",
                         help="also print the kernels cuBLAS launched for each shape")
    measure.add_argument("--every", type=int, default=1,
                         help="only every Nth case (a sample of a long list)")
    measure.add_argument("--shape", action="append",
                         help="MxNxK (bf16, Linear layout; MxNxK:kn for b [K, N]) instead of "
                              "the models tier's shapes")
    measure.add_argument("--compile-only", action="store_true",
                         help="build the programs (into TILEOPS_CACHE_DIR) and stop")
    measure.set_defaults(fn=cmd_measure)
    fit = sub.add_parser("fit")
    fit.add_argument("measured", nargs="?",
                     default=str(ROOT / "docs/performance/h200-gemm-selection-2026-12-02.md"))
    fit.set_defaults(fn=cmd_fit)
    table = sub.add_parser("table")
    table.add_argument("--models", action="append", help="only models whose name contains TEXT")
    table.set_defaults(fn=cmd_table)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
