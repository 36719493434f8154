"""Issue 17's per-workload tables from `tileops bench` reports: each row's bytes, latency,
TB/s, % of the card's calibrated bandwidth, best baseline and speed-up, with the rows short
of a target in bold, and a count of them. No GPU needed:

    python scripts/layer_op_targets.py gpu-out/bench/bench.json [more.json ...] \
        --out docs/performance/h100-layer-ops-DATE.md

Targets (issue 17): forward ops >= 90% and backward ops (names with `Bwd`) >= 85% of the
calibrated bandwidth on rows moving at least 32 MB; every row >= 1.0x the best baseline.
Rows of several reports are kept in the reports' order, grouped by op.
"""

import argparse
import json
import pathlib

MIN_MB = 32.0
FORWARD_PCT, BACKWARD_PCT = 90.0, 85.0


def load_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        rows += data["rows"] if isinstance(data, dict) else data
    return rows


def shortfalls(row: dict) -> tuple[bool, bool]:
    """(short of the bandwidth target, under 1.0x the best baseline) for one bench row."""
    megabytes = row["tbps"] * row["latency_us"]  # TB/s x us = MB
    need = BACKWARD_PCT if "Bwd" in row["op"] else FORWARD_PCT
    slow = megabytes >= MIN_MB and row["sol_pct"] < need
    behind = bool(row.get("best_baseline")) and row["speedup"] < 1.0
    return slow, behind


def markdown(rows: list[dict]) -> str:
    slow_rows = behind_rows = close_rows = 0
    parts = []
    for op in dict.fromkeys(r["op"] for r in rows):
        lines = [f"## {op}", "",
                 "| workload | dtype | MB | us | TB/s | % | best baseline (us) | speed-up |",
                 "|---|---|--:|--:|--:|--:|---|--:|"]
        for r in (r for r in rows if r["op"] == op):
            slow, behind = shortfalls(r)
            slow_rows += slow
            behind_rows += behind
            close_rows += behind and r["speedup"] >= 0.99
            pct = f"{r['sol_pct']:.1f}"
            best = r.get("best_baseline")
            base = f"{best} ({r['baselines'][best]:.2f})" if best else "-"
            speedup = f"{r['speedup']:.3f}x" if best else "-"
            lines.append(
                f"| {r['label'].replace('|', '/')} | {r['dtype']} | "
                f"{r['tbps'] * r['latency_us']:.0f} | {r['latency_us']:.2f} | "
                f"{r['tbps']:.2f} | {f'**{pct}**' if slow else pct} | {base} | "
                f"{f'**{speedup}**' if behind else speedup} |")
        parts.append("\n".join(lines) + "\n")
    summary = (f"Rows: {len(rows)}; short of the bandwidth target: {slow_rows}; under 1.0x: "
               f"{behind_rows} ({close_rows} of them within 1%).\n")
    return summary + "\n" + "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="bench.json files")
    parser.add_argument("--out", help="write the tables here (default: print them)")
    args = parser.parse_args()
    text = markdown(load_rows(args.reports))
    if args.out:
        pathlib.Path(args.out).write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
