"""The models tier: public model configs -> GEMM, attention, norm, activation and loss
workloads, and its summary
(CPU only: derivation, the Ops' meta-tensor checks, the report, the command line)."""

import json
import math

import pytest

from tileops import cli
from tileops.perf import models, report
from tileops.perf.models import ATTENTION_BWD_OP, ATTENTION_FWD_OP, GEMM_OP


def linears(name):
    return {layer.name: (layer.n, layer.k) for layer in
            models.linear_layers(models.load_models()[name])}


def by_source(op_name, source):
    hits = [w for w in models.model_workloads(op_name) if source in w["sources"]]
    assert len(hits) == 1, source
    return hits[0]


# -- configs and derivation -------------------------------------------------------------------

def test_configs_load_with_every_family_the_issue_names():
    names = list(models.load_models())
    for wanted in ("llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b",
                   "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b", "qwen3-0.6b", "qwen3-8b",
                   "qwen3-32b", "qwen3-235b-a22b", "mistral-7b-v0.1", "mixtral-8x7b",
                   "gemma-2-9b", "gemma-2-27b", "gemma-3-4b", "gemma-3-27b", "phi-2",
                   "phi-3-mini-4k", "phi-4", "deepseek-v3", "vit-l-16"):
        assert wanted in names
    for name, cfg in models.load_models().items():
        assert cfg["source"].startswith("https://huggingface.co/"), name


def test_derived_counts_are_plausible():
    gemm = models.model_workloads(GEMM_OP)
    shapes = {w["config"] for w in gemm}
    assert 100 <= len(shapes) <= 250  # ~27 models x ~8 Linears, less what they share
    assert len(gemm) <= len(shapes) * len(models.TOKEN_COUNTS)
    fwd, bwd = models.model_workloads(ATTENTION_FWD_OP), models.model_workloads(ATTENTION_BWD_OP)
    assert 20 <= len({w["config"] for w in fwd}) <= 40
    assert {w["config"] for w in fwd} == {w["config"] for w in bwd}
    assert 60 <= len(fwd) <= 150 and len(bwd) < len(fwd)


def test_llama_3_1_8b_linear_shapes():
    assert linears("llama3.1-8b") == {
        "qkv_proj": (6144, 4096), "q_proj": (4096, 4096), "k_proj": (1024, 4096),
        "v_proj": (1024, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
        "gate_proj": (14336, 4096), "up_proj": (14336, 4096), "down_proj": (4096, 14336),
        "lm_head": (128256, 4096)}
    w = by_source(GEMM_OP, "llama3.1-8b o_proj 4096 tokens")
    assert w["inputs"] == {"a": [4096, 4096], "b": [4096, 4096]}
    assert w["label"].startswith("llama3.1-8b q_proj 4096 tokens")  # q_proj came first
    assert by_source(GEMM_OP, "llama3.1-8b down_proj 1 tokens")["inputs"] == {
        "a": [1, 14336], "b": [4096, 14336]}


def test_deepseek_v3_dense_parts():
    assert linears("deepseek-v3") == {
        "q_a_proj": (1536, 7168), "q_b_proj": (128 * 192, 1536),
        "kv_a_proj_with_mqa": (576, 7168), "kv_b_proj": (128 * 256, 512),
        "fused_qkv_a_proj": (2112, 7168), "o_proj": (7168, 128 * 128),
        "gate_up_proj": (36864, 7168), "gate_proj": (18432, 7168), "up_proj": (18432, 7168),
        "down_proj": (7168, 18432), "router": (256, 7168),
        "shared_expert.gate_up_proj": (4096, 7168), "shared_expert.gate_proj": (2048, 7168),
        "shared_expert.up_proj": (2048, 7168), "shared_expert.down_proj": (7168, 2048),
        "lm_head": (129280, 7168)}
    w = by_source(ATTENTION_FWD_OP, "deepseek-v3 prefill 4 x 8k causal")
    assert w["inputs"] == {"q": [4, 8192, 128, 192], "k": [4, 8192, 128, 192],
                           "v": [4, 8192, 128, 128]}
    w = by_source(ATTENTION_BWD_OP, "deepseek-v3 training 4 x 8k causal")
    assert w["inputs"]["do"] == w["inputs"]["o"] == [4, 8192, 128, 128]


def test_moe_models_derive_only_their_dense_parts():
    assert linears("mixtral-8x7b") == {
        "qkv_proj": (6144, 4096), "q_proj": (4096, 4096), "k_proj": (1024, 4096),
        "v_proj": (1024, 4096), "o_proj": (4096, 4096), "router": (8, 4096),
        "lm_head": (32000, 4096)}
    assert models.load_models()["mixtral-8x7b"]["moe"]["expert_intermediate"] == 14336
    qwen = linears("qwen3-235b-a22b")
    assert qwen["q_proj"] == (8192, 4096) and qwen["router"] == (128, 4096)
    assert not any("gate" in name or "down" in name for name in qwen)


def test_fused_checkpoints_and_plain_mlps():
    assert linears("phi-3-mini-4k") == {
        "qkv_proj": (9216, 3072), "o_proj": (3072, 3072), "gate_up_proj": (16384, 3072),
        "down_proj": (3072, 8192), "lm_head": (32064, 3072)}
    assert linears("vit-l-16") == {
        "qkv_proj": (3072, 1024), "q_proj": (1024, 1024), "k_proj": (1024, 1024),
        "v_proj": (1024, 1024), "o_proj": (1024, 1024), "fc1": (4096, 1024),
        "fc2": (1024, 4096)}


def test_kv_ratios_head_dims_and_masks_are_covered():
    fwd = models.model_workloads(ATTENTION_FWD_OP)
    ratios = {w["inputs"]["q"][2] // w["inputs"]["k"][2] for w in fwd}
    assert {1, 2, 3, 4, 5, 6, 7, 8, 16} <= ratios
    seven = {m for w in fwd if w["inputs"]["q"][2] == 7 * w["inputs"]["k"][2]
             for m in w["models"]}
    assert {"qwen2.5-7b", "qwen2.5-0.5b"} <= seven
    dims = {(w["inputs"]["q"][3], w["inputs"]["v"][3]) for w in fwd}
    assert {(64, 64), (72, 72), (80, 80), (96, 96), (128, 128), (256, 256), (192, 128)} <= dims
    assert {w["params"]["is_causal"] for w in fwd} == {True, False}
    windows = {w["params"].get("window_size", [-1, -1])[0] for w in fwd}
    assert {-1, 1023, 2046, 4095} <= windows
    gemma2 = by_source(ATTENTION_FWD_OP, "gemma-2-27b prefill 4 x 8k global layer causal")
    assert gemma2["params"] == {"is_causal": True, "softcap": 50.0, "scale": 144 ** -0.5}


def test_sequence_plan_keeps_tokens_in_flight_and_the_context():
    cfgs = models.load_models()
    assert models.sequence_plan(cfgs["llama3.1-8b"], backward=False) == [
        (64, 512), (16, 2048), (4, 8192), (1, 32768), (1, 131072)]
    assert models.sequence_plan(cfgs["llama3.1-8b"], backward=True) == [
        (16, 2048), (4, 8192), (1, 32768)]
    assert models.sequence_plan(cfgs["phi-2"], backward=False) == [(64, 512), (16, 2048)]
    assert models.sequence_plan(cfgs["phi-4"], backward=False)[-1] == (2, 16384)
    assert models.sequence_plan(cfgs["vit-l-16"], backward=True) == [(166, 197)]
    assert models.token_counts(cfgs["vit-l-16"]) == [512, 4096, 16384]
    assert models.token_counts(cfgs["qwen3-8b"]) == list(models.TOKEN_COUNTS)


def test_dedup_counts_a_shape_once_and_remembers_every_source():
    for op_name in models.MODEL_OPS:
        workloads = models.model_workloads(op_name)
        keys = [json.dumps([w["inputs"], w.get("params", {})], sort_keys=True)
                for w in workloads]
        assert len(set(keys)) == len(keys), op_name
        assert len({w["label"] for w in workloads}) == len(workloads), op_name
    shared = by_source(ATTENTION_FWD_OP, "qwen3-8b prefill 4 x 8k causal")
    assert {"llama3.1-8b", "qwen3-8b", "mixtral-8x7b"} <= set(shared["models"])
    assert shared["label"] == "llama3.1-8b prefill 4 x 8k causal (+2 more)"
    gate = by_source(GEMM_OP, "mistral-7b-v0.1 gate_proj 512 tokens")
    assert "llama3.1-8b up_proj 512 tokens" in gate["sources"]
    # a --models filter keeps the same labels (history comparisons stay valid)
    only_qwen = models.model_workloads(ATTENTION_FWD_OP, ["qwen3-8b"])
    assert shared["label"] in {w["label"] for w in only_qwen}
    assert all("qwen3-8b" in w["models"] for w in only_qwen)


def test_workloads_have_the_manifest_form_and_rooflines():
    from tileops.ops import OP_CLASSES

    for op_name in models.MODEL_OPS:
        spec = OP_CLASSES[op_name].spec
        for w in models.model_workloads(op_name, ["llama3.1-8b"])[:3]:
            assert w["dtypes"] == models.DTYPES
            tensors = spec.workload_tensors(w, "bfloat16", stand_ins=True)
            ns = spec.namespace(tensors, spec.workload_params(w))
            spec.check_shapes(ns)
            flops, nbytes = spec.eval_roofline(ns)
            assert flops > 0 and nbytes > 0


def test_the_current_ops_refuse_unsupported_head_dims_and_nothing_else():
    from tileops.ops import OP_CLASSES

    refused_configs = {}
    for op_name in models.MODEL_OPS:
        accepted, refused = models.split_refused(OP_CLASSES[op_name],
                                                 models.model_workloads(op_name))
        assert accepted
        for r in refused:
            assert r["op"] == op_name and r["reason"].startswith(op_name)
            refused_configs.setdefault(op_name, set()).add(r["config"])
    assert GEMM_OP not in refused_configs  # every Linear shape is served today
    # a kernel update that serves one of these makes this fail: then drop it from the list
    assert refused_configs[ATTENTION_FWD_OP] == {"16/16 heads, head_dim 72, bidirectional"}
    # the backward has no head_dim 80 and no q/k 192 with v 128 yet (see the manifest's rule)
    assert refused_configs[ATTENTION_BWD_OP] == refused_configs[ATTENTION_FWD_OP] | {
        "32/32 heads, head_dim 80, causal",
        "128/128 heads, head_dim 192 (q/k) / 128 (v), causal"}


def test_bench_cases_of_the_models_tier_skip_refused_shapes_and_default_to_bf16():
    from tileops.ops import OP_CLASSES
    from tileops.perf.bench import bench_cases

    ops = [OP_CLASSES[n] for n in (ATTENTION_FWD_OP, "SoftmaxFwdOp")]  # softmax: no shapes
    cases = list(bench_cases(ops, "models", models=["phi", "llama3.2-1b"]))
    assert {c.__name__ for c, _, _ in cases} == {ATTENTION_FWD_OP}
    assert {d for _, _, d in cases} == {"bfloat16"}
    assert {m for _, w, _ in cases for m in w["models"]} == {"phi-2", "phi-3-mini-4k", "phi-4",
                                                             "llama3.2-1b"}
    fp16 = list(bench_cases(ops, "models", ["float16"], ["128k"], ["llama"]))
    assert fp16 and all(d == "float16" and "128k" in w["label"] for _, w, d in fp16)


# -- the summary --------------------------------------------------------------------------------

def row(op, label, speedup, baseline="cublas", dtype="bfloat16"):
    return {"op": op, "label": label, "dtype": dtype, "latency_us": 10.0,
            "speedup": speedup, "best_baseline": baseline if speedup else "",
            "baselines": {baseline: 10.0 * speedup} if speedup else {}}


def test_speedup_summary_gives_geomean_worst_and_the_slowest_shapes():
    rows = [row("GemmFwdOp", "a", 2.0), row("GemmFwdOp", "b", 0.5),
            row("GemmFwdOp", "c", 1.0), row("GemmFwdOp", "d", 0.25),
            row("GemmFwdOp", "e", 0.0),  # no baseline: counted, not averaged
            row("Attn", "x", 1.1, "sdpa-cudnn"), row("Attn", "y", 0.9, "sdpa-cudnn")]
    gemm, attn = report.speedup_summary(rows, worst_n=2)
    assert gemm.op == "GemmFwdOp" and gemm.cases == 4 and gemm.no_baseline == 1
    assert gemm.geomean == pytest.approx((2.0 * 0.5 * 1.0 * 0.25) ** 0.25)
    assert gemm.worst == 0.25
    assert [w["label"] for w in gemm.worst_rows] == ["d", "b"]
    assert gemm.worst_rows[0] == {"label": "d", "dtype": "bfloat16", "speedup": 0.25,
                                  "best_baseline": "cublas"}
    assert attn.geomean == pytest.approx(math.sqrt(1.1 * 0.9)) and attn.worst == 0.9
    (lonely,) = report.speedup_summary([row("X", "z", 0.0)])
    assert lonely.cases == 0 and math.isnan(lonely.geomean)


def test_summary_is_the_same_from_a_stored_report(tmp_path):
    rows = [{**row("GemmFwdOp", f"s{i}", s), "tflops": 1.0, "tbps": 1.0, "sol_us": 1.0,
             "sol_pct": 10.0, "bound": "compute"} for i, s in enumerate((0.8, 1.2, 0.6))]
    refused = [{"op": ATTENTION_FWD_OP, "label": "phi-2 prefill 64 x 512 causal",
                "config": "32/32 heads, head_dim 80, causal", "models": ["phi-2"],
                "reason": "D in (64, 128, 256)"}]
    path = report.write_json(rows, tmp_path / "bench.json", {"tier": "models",
                                                             "refused": refused})
    stored = report.read_json(path)
    assert (report.speedup_summary_markdown(stored["rows"], stored["meta"]["refused"])
            == report.speedup_summary_markdown(rows, refused))


def test_summary_markdown_names_worst_shapes_and_groups_refusals():
    refused = [{"op": ATTENTION_FWD_OP, "label": f"phi-2 prefill {b} causal",
                "config": "32/32 heads, head_dim 80, causal", "models": ["phi-2"],
                "reason": "D in (64, 128, 256)"} for b in ("64 x 512", "16 x 2k")]
    refused.append({**refused[0], "config": "16/16 heads, head_dim 72, bidirectional",
                    "models": ["siglip-so400m"]})
    groups = report.group_refused(refused)
    assert [(g["config"], g["workloads"]) for g in groups] == [
        ("32/32 heads, head_dim 80, causal", 2), ("16/16 heads, head_dim 72, bidirectional", 1)]
    text = report.speedup_summary_markdown(
        [row("GemmFwdOp", "llama3.1-8b k_proj 8 tokens", 0.5), row("GemmFwdOp", "big", 1.5),
         row("GemmFwdOp", "none", 0.0)], refused)
    assert "| GemmFwdOp | 2 | 0.87x | 0.50x | llama3.1-8b k_proj 8 tokens [bfloat16] 0.50x " \
           "vs cublas; big [bfloat16] 1.50x vs cublas (1 rows without a baseline) |" in text
    assert "Refused by the current ops (3 workloads, not timed)" in text
    assert "| 32/32 heads, head_dim 80, causal | phi-2 | 2 |" in text


# -- the command line ---------------------------------------------------------------------------

def test_models_tier_parses_and_needs_a_gpu_in_one_line(capsys, monkeypatch):
    import torch

    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--tier", "models", "--help"])
    assert done.value.code == 0 and "--models TEXT" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--tier", "models", "--models", "llama3.1-8b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA device" in err


@pytest.mark.parametrize("argv, message", [
    (["--models", "llama"], "--models selects model shapes: it needs --tier models"),
    (["--tier", "models", "--models", "gpt-5"], "no model matches --models gpt-5; models: "),
    (["--tier", "models", "--op", "SoftmaxFwdOp"], "the models tier covers GemmFwdOp, "),
    (["--tier", "models", "--dtype", "float8_e4m3fn"], "no workload of any op matches "),
])
def test_models_tier_usage_errors(capsys, argv, message):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_models_tier_run_reports_summary_and_refusals(tmp_path, capsys, monkeypatch):
    """The whole command on a CPU, the timing faked: the report has the per-op summary and
    lists the shapes the ops refused instead of timing them."""
    import torch

    from tileops.perf import bench

    def fake_bench(op_cls, workload, dtype, **kwargs):
        speedup = 0.5 if "qkv_proj" in workload["label"] else 1.25
        return bench.BenchRow(op_cls.__name__, workload["label"], dtype, 10.0, 1.0, 1.0, 5.0,
                              50.0, "memory", {"cublas": 10.0 * speedup}, "cublas", speedup)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(bench, "bench_workload", fake_bench)
    monkeypatch.setattr(report, "plot_roofline", lambda *a: None)
    monkeypatch.setattr(report, "plot_speedups", lambda *a: None)
    out = tmp_path / "out"
    assert cli.main(["bench", "--tier", "models", "--models", "phi-2", "--workload", "512",
                     "--workload", "16 x 2k", "--op", GEMM_OP, ATTENTION_BWD_OP,
                     "--out", str(out)]) == 0
    stored = report.read_json(out / "bench.json")
    assert stored["meta"]["tier"] == "models"
    assert {r["op"] for r in stored["rows"]} == {GEMM_OP}  # phi-2's attention backward: refused
    assert [r["label"] for r in stored["meta"]["refused"]] == ["phi-2 training 16 x 2k causal"]
    md = (out / "bench.md").read_text()
    assert "| GemmFwdOp |" in md and "0.50x | phi-2 qkv_proj 512 tokens" in md
    assert "| GroupedQueryAttentionBwdOp | 32/32 heads, head_dim 80, causal | phi-2 | 1 |" in md
    assert "model workloads refused by the current ops" in capsys.readouterr().out


def test_layer_and_loss_ops_follow_each_models_norm_activation_and_vocab():
    """Norms by each model's type and sizes (q/k norms for Qwen3 and Gemma-3, DeepSeek-V3's
    latent norms), gated activations by its hidden_act, the loss by its vocabulary."""
    rms = by_source("RMSNormFwdOp", "llama3.1-8b norm 4096 tokens")
    assert rms["inputs"] == {"input": [4096, 4096], "weight": [4096]}
    assert rms["params"] == {"normalized_shape": [4096]}
    assert by_source("RMSNormFwdOp", "qwen3-8b k_norm 4096 tokens")["inputs"]["input"] == [
        4096 * 8, 128]
    assert by_source("RMSNormBwdOp", "deepseek-v3 kv_a_layernorm 16384 tokens")[
        "inputs"]["input"] == [16384, 512]
    assert not [w for w in models.model_workloads("RMSNormFwdOp") if "phi-2" in w["models"]]
    assert by_source("LayerNormFwdOp", "phi-2 norm 4096 tokens")["inputs"]["bias"] == [2560]
    silu = by_source("SiluAndMulFwdOp", "llama3.1-8b mlp 512 tokens")
    assert silu["inputs"] == {"x": [512, 28672]} and silu["params"] == {}
    gelu = by_source("GeluAndMulBwdOp", "gemma-2-9b mlp 4096 tokens")
    assert gelu["params"] == {"approximate": "tanh"}
    assert gelu["inputs"] == {"grad_out": [4096, 14336], "x": [4096, 28672]}
    ce = {w["inputs"]["input"][1] for w in models.model_workloads("CrossEntropyFwdOp")}
    assert {32000, 128256, 151936, 256000, 129280} <= ce
    assert all(w["tokens"] in models.TRAINING_TOKENS
               for op in ("CrossEntropyBwdOp", "RMSNormBwdOp")
               for w in models.model_workloads(op))
    head = by_source("FusedLinearCrossEntropyFwdOp", "llama3.1-8b lm head loss 4096 tokens")
    assert head["inputs"]["weight"] == [128256, 4096]
