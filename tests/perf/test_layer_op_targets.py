"""scripts/layer_op_targets.py marks the rows short of issue 17's targets, and only those."""

from ..helpers import load_script


def row(op, label, latency_us, tbps, sol_pct, speedup, best="liger"):
    return {"op": op, "label": label, "dtype": "bfloat16", "latency_us": latency_us,
            "tbps": tbps, "sol_pct": sol_pct, "speedup": speedup, "best_baseline": best,
            "baselines": {best: latency_us * speedup} if best else {}}


def test_targets_by_direction_size_and_speedup(tmp_path):
    targets = load_script("layer_op_targets")
    rows = [row("RMSNormFwdOp", "fwd 89%, 100 MB", 40.0, 2.5, 89.0, 1.2),
            row("RMSNormBwdOp", "bwd 89%, 100 MB", 40.0, 2.5, 89.0, 1.2),
            row("RMSNormFwdOp", "fwd 10%, 2 MB", 2.0, 1.0, 10.0, 1.0),
            row("SwigluFwdOp", "a tie | under", 100.0, 3.0, 98.0, 0.995),
            row("SwigluFwdOp", "no baseline", 100.0, 3.0, 98.0, 0.0, best="")]
    assert [targets.shortfalls(r) for r in rows] == [
        (True, False), (False, False), (False, False), (False, True), (False, False)]
    text = targets.markdown(rows)
    assert text.startswith("Rows: 5; short of the bandwidth target: 1; under 1.0x: 1 "
                           "(1 of them within 1%).")
    assert "| fwd 89%, 100 MB | bfloat16 | 100 | 40.00 | 2.50 | **89.0** |" in text
    assert "| bwd 89%, 100 MB | bfloat16 | 100 | 40.00 | 2.50 | 89.0 |" in text
    assert "| a tie / under |" in text and "**0.995x** |" in text
    # one table an op, in the reports' order
    assert [line for line in text.splitlines() if line.startswith("## ")] == [
        "## RMSNormFwdOp", "## RMSNormBwdOp", "## SwigluFwdOp"]
