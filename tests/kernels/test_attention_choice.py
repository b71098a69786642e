"""The per-shape SDPA kernel table (kernels/attention_choice.py): its schema, the routing of the
`sdpa` backend through it, compiled blocks tracing the choice without a break, and the tool that
measures and writes it (tools/choose_attention.py), on CPU, where SDPA has a flash and a math kernel."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import profile

from kernels import attention_choice
from kernels.attention import math_attention, sdpa_attention

CPU = torch.device("cpu")


def entry(**over) -> dict:
    return {"capability": "cpu", "dtype": "fp32", "attention": "dense", "heads": 2, "tokens": 17, "head_dim": 16,
            "kernel": "math", "measured": {"ms": {}}, **over}


def table(tmp_path: Path, *entries) -> Path:
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"entries": list(entries)}))
    return path


@pytest.fixture(autouse=True)
def nothing_active_after():
    yield
    attention_choice.deactivate()


def sdpa_ops(q: torch.Tensor) -> set[str]:
    """The aten SDPA kernels one call of the `sdpa` backend ran."""
    with profile() as prof:
        sdpa_attention(q, q, q)
    return {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}


def test_a_listed_shape_runs_its_kernel_and_the_others_keep_pytorchs_pick(tmp_path):
    path = table(tmp_path, entry(kernel="math"), entry(heads=4, kernel="pytorch"))
    listed, other = torch.randn(3, 2, 17, 16), torch.randn(3, 2, 18, 16)
    assert sdpa_ops(listed) == {"aten::_scaled_dot_product_flash_attention_for_cpu"}  # before: PyTorch's pick
    assert attention_choice.activate(CPU, path) == 2
    assert sdpa_ops(listed) == {"aten::_scaled_dot_product_attention_math"}
    assert sdpa_ops(other) == {"aten::_scaled_dot_product_flash_attention_for_cpu"}
    assert sdpa_ops(torch.randn(3, 4, 17, 16)) == {"aten::_scaled_dot_product_flash_attention_for_cpu"}
    assert sdpa_ops(listed.double()) == {"aten::_scaled_dot_product_flash_attention_for_cpu"}  # another dtype
    torch.testing.assert_close(sdpa_attention(listed, listed, listed), math_attention(listed, listed, listed))


def test_another_capability_is_not_activated(tmp_path):
    assert attention_choice.activate(CPU, table(tmp_path, entry(capability="9.0"))) == 0
    assert attention_choice.kernel_for(torch.randn(3, 2, 17, 16)) is None
    assert attention_choice.activate(CPU, tmp_path / "absent.json") == 0


def test_a_compiled_block_traces_the_choice_without_a_break(tmp_path):
    """fullgraph: a graph break would raise; aot_eager keeps the chosen aten kernel visible."""
    from model.vit import Block

    torch.manual_seed(0)
    block = Block(32, 2, attn_backend="sdpa")
    x = torch.randn(3, 17, 32, requires_grad=True)
    want = block(x)
    attention_choice.activate(CPU, table(tmp_path, entry(kernel="math")))
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    with profile() as prof:
        got = compiled(x)
        got.sum().backward()
    kernels = {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}
    assert kernels == {"aten::_scaled_dot_product_attention_math"}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("change, said", [
    ({"kernel": "fastest"}, "kernel 'fastest' is not one of"),
    ({"capability": "sm90"}, "capability 'sm90' is neither"),
    ({"capability": "9.0a"}, "capability '9.0a' is neither"),  # a valid key with more after it
    ({"dtype": "float32"}, "dtype 'float32' is not one of"),
    ({"heads": 0}, "heads 0 is not an integer"),
    ({"heads": 2**21}, "heads 2097152 is not an integer in [1, 2^20]"),  # past the upper bound
    ({"tokens": 50.0}, "tokens 50.0 is not an integer"),
    ({"head_dim": True}, "head_dim True is not an integer"),
    ({"measured": []}, "measured must be an object"),
    ({"attention": "segment"}, "attention 'segment' is not one of"),
    ({"attention": "topk", "kernel": "math"}, "kernel 'math' is not one of ['fused', 'masked_sdpa'] (for topk"),
    ({"kernel": "masked_sdpa"}, "kernel 'masked_sdpa' is not one of"),
    ({"extra": 1}, "it must have exactly"),
    ({"dtype": ["bf16"]}, "dtype ['bf16'] is not one of"),  # unhashable values: refused, not a TypeError
    ({"attention": {"dense": 1}}, "attention {'dense': 1} is not one of"),
    ({"kernel": ["math"]}, "kernel ['math'] is not one of"),
])
def test_a_bad_entry_is_refused_with_where_and_what(tmp_path, change, said):
    path = table(tmp_path, entry(), entry(**{"tokens": 18, **change}))
    with pytest.raises(ValueError, match="entry 1") as e:
        attention_choice.load(path)
    assert said in str(e.value) and str(path) in str(e.value) and "choose_attention --write" in str(e.value)


def test_a_repeated_shape_and_a_malformed_file_are_refused(tmp_path):
    with pytest.raises(ValueError, match="entry 1 repeats capability cpu"):
        attention_choice.load(table(tmp_path, entry(), entry(kernel="flash")))
    path = tmp_path / "broken.json"
    path.write_text('{"entries": [')
    with pytest.raises(ValueError, match="is not JSON"):
        attention_choice.load(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match='an "entries" list'):
        attention_choice.load(path)


def test_a_table_nested_too_deep_is_refused_as_malformed(tmp_path):
    """json raises RecursionError, not a ValueError, for arrays nested past Python's recursion limit."""
    path = tmp_path / "choices.json"
    path.write_text('{"entries": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError) as e:
        attention_choice.load(path)
    assert str(e.value).startswith(f"{path}: is nested too deep to be read as JSON") and "\n" not in str(e.value)
    assert "choose_attention --write" in str(e.value)


@settings(max_examples=150, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["entries", *entry()]), inner, max_size=8), max_leaves=20))
def test_any_json_either_loads_or_is_refused_as_a_value_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("any") / "choices.json"
    path.write_text(json.dumps(data))
    try:
        choices = attention_choice.load(path)
    except ValueError as e:
        assert str(path) in str(e)
    else:
        assert all(c.kernel in attention_choice.ATTENTIONS[c.attention] for c in choices)


def test_the_shape_bounds_are_inclusive(tmp_path):
    assert [c.heads for c in attention_choice.load(table(tmp_path, entry(heads=1), entry(heads=2**20)))] == [1, 2**20]


def test_the_committed_table_loads():
    assert all(c.kernel in attention_choice.ATTENTIONS[c.attention] for c in attention_choice.load())


def test_choose_takes_the_fastest_only_past_the_margin():
    ms = {"flash": 1.0, "cudnn": 0.90, "efficient": "not available: x", "math": 3.0, "pytorch": 1.0}
    assert attention_choice.choose(ms) == "cudnn"
    assert attention_choice.choose({**ms, "cudnn": 0.98}) == "pytorch"  # within the margin: PyTorch keeps choosing
    with pytest.raises(ValueError, match="the default kernel 'pytorch' did not run"):
        attention_choice.choose({**ms, "pytorch": "not available: y"})
    # TopK: the fused kernels are the default the other path must beat
    assert attention_choice.choose({"fused": 2.4, "masked_sdpa": 1.9}, default="fused") == "masked_sdpa"
    assert attention_choice.choose({"fused": 2.4, "masked_sdpa": 2.37}, default="fused") == "fused"


def test_the_tool_times_the_runs_shapes_and_merges_its_entries(tmp_path, capsys):
    from tools import choose_attention

    path = table(tmp_path, entry(heads=5, kernel="flash"), entry(capability="9.0", heads=12, tokens=50,
                                                                  head_dim=64))
    argv = ["--device", "cpu", "--dtype", "fp32", "--micro", "2", "--iters", "1", "--model", "vit_base_patch16",
            "--config", "defaults", "--table", str(path)]
    choices = choose_attention.main(argv)
    # MAE ViT-B/16 at 224, mask 0.75: the encoder's 49 visible patches + cls, the decoder's 197 tokens
    assert {(c.heads, c.tokens, c.head_dim) for c in choices} == {(12, 50, 64), (16, 197, 32)}
    assert {c.attention for c in choices} == {"dense"}  # TopK is timed on a GPU with Triton only
    assert "TopK 12x197x64: not available: not on a GPU" in capsys.readouterr().out
    for c in choices:
        assert isinstance(c.measured["ms"]["pytorch"], float) and isinstance(c.measured["ms"]["math"], float)
        assert c.measured["ms"]["cudnn"].startswith("not available")  # no cuDNN kernel on CPU
        assert c.kernel == attention_choice.choose(c.measured["ms"])
    kept = {(c.capability, c.heads) for c in attention_choice.load(path)}
    assert kept == {("cpu", 5), ("9.0", 12), ("cpu", 12), ("cpu", 16)}  # merged, the other capability kept
    choose_attention.main(argv)  # again: the same keys are replaced, not repeated
    assert len(attention_choice.load(path)) == 4


@pytest.mark.parametrize("timed, chosen", [
    ({"fused": 2.4, "masked_sdpa": 2.37}, "fused"),  # within the margin: the fused kernel, the default
    ({"fused": 2.4, "masked_sdpa": 1.9}, "masked_sdpa"),
    ({"fused": "not available: a Triton error", "masked_sdpa": 1.9}, "masked_sdpa"),  # the path that ran
])
def test_topk_entries_record_the_path_chosen_with_its_shape(tmp_path, monkeypatch, capsys, timed, chosen):
    """TopK timings stood in for (the kernels run on a GPU only): the entry records the kernel, the
    MixedAE ViT-B preset's batch of mixed images (micro-batch 8 / g 4 = 2) and K, and the commit;
    a fused kernel that fails on the GPU leaves the masked-SDPA path, which is recorded, not a crash."""
    from tools import choose_attention

    seen = []
    monkeypatch.setattr(choose_attention, "time_topk", lambda *shape: seen.append(shape[:5]) or dict(timed))
    argv = ["--device", "cpu", "--dtype", "fp32", "--micro", "8", "--iters", "1", "--model", "vit_base_patch16",
            "--config", "defaults", "--topk_config", "train/configs/mixedae/vit_b.json", "--table",
            str(tmp_path / "choices.json")]
    [topk] = [c for c in choose_attention.main(argv) if c.attention == "topk"]
    assert seen == [(2, 12, 197, 64, topk.measured["k"])]
    assert (topk.heads, topk.tokens, topk.head_dim, topk.kernel) == (12, 197, 64, chosen)
    assert topk.measured["batch"] == 2 and topk.measured["ms"] == timed and topk.measured["commit"]
    assert f"chosen {chosen}" in capsys.readouterr().out


@pytest.mark.parametrize("gpu,ds_config,entries,kernels", [
    ("h100", "vit_b_8xh100_bf16_zero1.json",
     [dict(capability="9.0", dtype="bf16", heads=12, tokens=50, head_dim=64, kernel="cudnn"),
      dict(capability="8.0", dtype="bf16", heads=16, tokens=197, head_dim=32, kernel="flash")],
     "bf16 on sm90; heads x tokens x head dim): 12x50x64 cudnn (measured fastest)"),
    # a V100 run in fp16 takes the table's fp16 entry for its shape, not a bf16 one of the same shape
    ("v100", "vit_b_8xv100_fp16_zero1.json",
     [dict(capability="7.0", dtype="fp16", heads=12, tokens=50, head_dim=64, kernel="cudnn"),
      dict(capability="7.0", dtype="bf16", heads=12, tokens=50, head_dim=64, kernel="efficient")],
     "fp16 on sm70; heads x tokens x head dim): 12x50x64 cudnn (measured fastest)"),
])
def test_the_dry_run_states_each_shapes_kernel_from_its_gpus_and_dtypes_entries(tmp_path, monkeypatch, gpu, ds_config,
                                                                                  entries, kernels):
    from train.config.parsing import parse_args
    from train.estimate.dry_run import check
    from train.estimate.gpus import gpu_named

    monkeypatch.setattr(attention_choice, "TABLE", table(tmp_path, *(entry(**e) for e in entries)))
    cfg = parse_args(["--ds_config", f"ds_configs/{ds_config}", "--data.source", "synthetic"])
    line, = [x for x in check(cfg, 8, gpu_named(gpu)).lines if x.startswith("attention kernels")]
    assert line == f"attention kernels ({kernels}; 16x197x32 PyTorch's pick (not measured)"

@pytest.mark.parametrize("preset, gpu, said", [
    ("energy/vit_b.json", "h100", "12x197x64 math reference"),  # twice differentiable: never a table kernel
    ("mixedae/vit_b.json", "h100", "12x197x64 topk: triton fused kernel"),
    ("mixedae/vit_b.json", "v100", "12x197x64 topk: PyTorch reference composition (compute capability sm_70 < sm_80"),
])
def test_the_dry_run_states_the_path_of_calls_the_table_does_not_decide(tmp_path, monkeypatch, preset, gpu, said):
    """The table's entry for a shape applies to dense SDPA calls only: the math backend, restricted
    (TopK, segment) and biased calls are said with their own path, as the run takes it."""
    from train.config.parsing import parse_args
    from train.estimate.dry_run import check
    from train.estimate.gpus import gpu_named

    monkeypatch.setattr(attention_choice, "TABLE", table(  # the encoder's shape measured: not what these calls run
        tmp_path, entry(capability="9.0", dtype="bf16", heads=12, tokens=197, head_dim=64, kernel="cudnn"),
        entry(capability="7.0", dtype="fp16", heads=12, tokens=197, head_dim=64, kernel="cudnn")))
    cfg = parse_args(["--ds_config", f"ds_configs/vit_b_8x{gpu}_{'fp16' if gpu == 'v100' else 'bf16'}_zero1.json",
                      "--config", f"train/configs/{preset}", "--data.source", "synthetic"])
    line, = [x for x in check(cfg, 8, gpu_named(gpu)).lines if x.startswith("attention kernels")]
    assert said in line and "cudnn" not in line


@pytest.mark.parametrize("capability, active", [((9, 0), 1), ((8, 0), 0)])
def test_a_gpu_activates_the_entries_of_its_compute_capability(tmp_path, monkeypatch, capability, active):
    """Faked capabilities: an H100 (9.0) takes the 9.0 entry, an A100 (8.0) none of them."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    path = table(tmp_path, entry(capability="9.0", dtype="bf16", kernel="cudnn"), entry(kernel="math"))
    assert attention_choice.capability_of(torch.device("cuda", 0)) == f"{capability[0]}.{capability[1]}"
    assert attention_choice.activate(torch.device("cuda", 0), path) == active
    q = torch.empty(3, 2, 17, 16, dtype=torch.bfloat16, device="meta")
    assert attention_choice.kernel_for(q) == (torch.nn.attention.SDPBackend.CUDNN_ATTENTION if active else None)


def test_topk_entries_pick_the_path_of_their_shape_beside_the_dense_entry_of_that_shape(tmp_path):
    path = table(tmp_path, entry(heads=12, tokens=197, head_dim=64, kernel="math"),
                 entry(attention="topk", heads=12, tokens=197, head_dim=64, kernel="masked_sdpa"),
                 entry(attention="topk", heads=16, tokens=197, head_dim=64, kernel="fused"))
    assert attention_choice.activate(CPU, path) == 3
    q = torch.empty(4, 12, 197, 64)
    assert attention_choice.topk_kernel_for(q) == "masked_sdpa"
    assert attention_choice.kernel_for(q) == torch.nn.attention.SDPBackend.MATH  # the dense entry still applies
    assert attention_choice.topk_kernel_for(torch.empty(4, 16, 197, 64)) == "fused"
    assert attention_choice.topk_kernel_for(torch.empty(4, 12, 50, 64)) == "fused"  # unlisted: the fused kernels
    assert attention_choice.topk_masked_shapes(torch.float32, 197, 64) == [12]
    assert attention_choice.choices_for("cpu", torch.float32, path) == {(12, 197, 64): "math"}  # dense only
    attention_choice.deactivate()
    assert attention_choice.topk_kernel_for(q) == "fused"


def test_a_gpu_that_refuses_the_fused_kernels_says_the_reference_path_for_topk_even_with_a_masked_sdpa_entry(
        tmp_path):
    """The table's masked_sdpa choice is a triton path: on an sm_70 GPU, where no triton kernel runs,
    TopK calls take the PyTorch reference composition, and the description must say so."""
    import importlib

    dispatch = importlib.import_module("kernels.attention")
    attention_choice.activate(CPU, table(tmp_path, entry(attention="topk", heads=12, tokens=197, head_dim=64,
                                                         kernel="masked_sdpa")))
    assert attention_choice.topk_masked_shapes(torch.float32, 197, 64) == [12]  # the entry is active
    said = dispatch.describe_paths("sdpa", CPU, torch.float32, 197, 64, capability=(7, 0))["topk"]
    assert said.startswith("PyTorch reference composition"), said


def test_activating_a_table_replaces_the_entries_of_an_earlier_one(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = table(tmp_path / "a", entry(heads=1, kernel="math"))
    second = table(tmp_path / "b", entry(heads=2, kernel="math"))
    assert attention_choice.activate(CPU, first) == 1
    assert attention_choice.kernel_for(torch.empty(3, 1, 17, 16)) == torch.nn.attention.SDPBackend.MATH
    assert attention_choice.activate(CPU, second) == 1
    assert attention_choice.kernel_for(torch.empty(3, 2, 17, 16)) == torch.nn.attention.SDPBackend.MATH
    assert attention_choice.kernel_for(torch.empty(3, 1, 17, 16)) is None  # only in the first table


def test_the_dispatch_routes_topk_through_the_path_the_table_chose(tmp_path, monkeypatch):
    """On a GPU the fused kernels would run; here both paths are stand-ins that say which ran."""
    pytest.importorskip("triton")
    import importlib

    from kernels.masked import TopKMask

    dispatch = importlib.import_module("kernels.attention")
    restricted = importlib.import_module("kernels.restricted_triton")
    ran = []
    monkeypatch.setattr(dispatch, "_fused_or_warn", lambda q: True)
    for name in ("topk_attention", "topk_attention_masked_sdpa"):
        monkeypatch.setattr(restricted, name, lambda q, k, v, rows, g, seg, name=name: (ran.append(name) or q, None))
    q = torch.randn(2, 12, 197, 8)
    dispatch.attention(q, q, q, mask=TopKMask(49))
    attention_choice.activate(CPU, table(tmp_path, entry(attention="topk", heads=12, tokens=197, head_dim=8,
                                                         kernel="masked_sdpa")))
    dispatch.attention(q, q, q, mask=TopKMask(49))
    dispatch.attention(torch.randn(2, 6, 197, 8), q, q, mask=TopKMask(49))  # another head count: fused
    assert ran == ["topk_attention", "topk_attention_masked_sdpa", "topk_attention"]
    said = dispatch.describe_paths("sdpa", torch.device("cuda"), torch.float32, 197, 8, capability=(9, 0))["topk"]
    assert said.startswith("triton threshold kernel + SDPA under the kept set as a mask (measured faster for 12 heads)")


def test_the_fused_topk_path_checks_a_per_query_k_as_the_reference_does(monkeypatch):
    """A per-query K of the wrong shape went to the Triton kernel unchecked, which read past its
    end (non-finite output); the reference path refused it. Both now refuse it, and the fused path
    gets K as (B, T) longs in [1, T]."""
    pytest.importorskip("triton")
    import importlib

    from kernels.masked import TopKMask

    dispatch = importlib.import_module("kernels.attention")
    restricted = importlib.import_module("kernels.restricted_triton")
    given = []
    monkeypatch.setattr(dispatch, "_fused_or_warn", lambda q: True)
    monkeypatch.setattr(restricted, "topk_attention", lambda q, k, v, rows, g, seg: (given.append(rows) or q, None))
    q = torch.randn(2, 2, 9, 8)
    with pytest.raises(ValueError, match=r"per-query K must have shape \(B, T\) = \(2, 9\), got \(2, 6\)"):
        dispatch.attention(q, q, q, mask=TopKMask(torch.ones(2, 6, dtype=torch.int32)))
    dispatch.attention(q, q, q, mask=TopKMask(torch.tensor([[0, 3, 20] * 3] * 2, dtype=torch.int32)))
    assert given[0].dtype == torch.long and given[0].tolist() == [[1, 3, 9] * 3] * 2


def test_topk_timing_says_why_not_without_a_gpu():
    from tools.choose_attention import time_topk

    ms = time_topk(2, 2, 17, 8, 4, torch.float32, CPU, iters=1)
    assert set(ms) == set(attention_choice.TOPK_KERNELS) and all(v == "not available: not on a GPU" for v in ms.values())


def test_a_topk_path_that_fails_keeps_the_other_paths_time(monkeypatch):
    """On a GPU the fused kernel may fail on a shape (Triton's resources, an assert): its reason is
    recorded and the masked-SDPA path is still timed, per call. Run here with the GPU's calls stood
    in for, and a stand-in clock that advances 2 ms a masked-SDPA call."""
    from types import SimpleNamespace

    import kernels.restricted_triton as restricted
    import tools.choose_attention as tool

    clock = [0.0]

    def fused(*args):
        raise AssertionError("BLOCK_N 128 exceeds shared memory")

    def masked_sdpa(q, k, v, k_rows, scale, segments):
        clock[0] += 0.002
        return q * k * v, None

    monkeypatch.setattr(tool, "_fused_reason", lambda probe: None)
    monkeypatch.setattr(tool, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(restricted, "topk_attention", fused)
    monkeypatch.setattr(restricted, "topk_attention_masked_sdpa", masked_sdpa)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    ms = tool.time_topk(2, 2, 17, 8, 4, torch.float32, CPU, iters=5, warmup=1)
    assert ms["fused"] == "not available: AssertionError: BLOCK_N 128 exceeds shared memory"
    assert ms["masked_sdpa"] == pytest.approx(2.0)  # ms per call, the warmup call outside the window


def test_the_tools_topk_shape_is_mixedaes_encoder_at_its_preset():
    from tools.choose_attention import DEFAULT_TOPK_CONFIGS, topk_shape_of

    # ViT-B/16 at 224, r = 1/4: 128 images make 32 mixed ones of 196 patches + cls, K = round(196 / 4) = 49
    assert topk_shape_of(DEFAULT_TOPK_CONFIGS[0], "vit_base_patch16", 128) == (32, 12, 197, 64, 49)
    assert topk_shape_of(DEFAULT_TOPK_CONFIGS[0], "vit_large_patch16", 128) == (32, 16, 197, 64, 49)


def test_a_kernel_that_fails_otherwise_than_pytorchs_refusal_is_recorded_and_the_others_are_timed(monkeypatch):
    """flash-attn-4 fails with CUTLASS DSL's own errors and asserts, not RuntimeError: that kernel
    gets the error's type and first line, every other kernel its time."""
    def failing(q, k, v):
        raise AssertionError("head_dim 16 is not supported\nmore detail")

    monkeypatch.setattr(attention_choice, "flash_attn4_refusal", lambda q, k, v, capability: None)
    monkeypatch.setattr(attention_choice, "flash_attn4_attention", failing)
    ms = attention_choice.time_kernels(2, 2, 17, 16, torch.float32, CPU, iters=1, warmup=1)
    assert ms["flash_attn4"] == "not available: AssertionError: head_dim 16 is not supported"
    assert isinstance(ms["pytorch"], float) and isinstance(ms["math"], float)


def choice(**over) -> attention_choice.Choice:
    return attention_choice.Choice(**entry(**over))


def test_merging_replaces_an_old_entry_with_the_new_one_of_its_key_and_keeps_the_rest():
    """The tool's fresh measurement must win over the table's stale one of the same key."""
    old = [choice(kernel="math"), choice(heads=3, kernel="efficient")]
    got = attention_choice.merged(old, [choice(kernel="flash"), choice(heads=4, kernel="cudnn")])
    assert [(e["heads"], e["kernel"]) for e in got["entries"]] == [(2, "flash"), (3, "efficient"), (4, "cudnn")]


def test_choices_for_reads_only_the_asked_dtype(tmp_path):
    path = table(tmp_path, entry(capability="9.0", dtype="fp16", heads=12, tokens=50, head_dim=64, kernel="cudnn"))
    assert attention_choice.choices_for("9.0", torch.float16, path) == {(12, 50, 64): "cudnn"}
    assert attention_choice.choices_for("9.0", torch.bfloat16, path) == {}  # the fp16 entry says nothing of bf16
    assert attention_choice.choices_for("8.0", torch.float16, path) == {}


def test_masked_topk_shapes_are_those_of_the_asked_dtype(tmp_path):
    attention_choice.activate(CPU, table(tmp_path, entry(dtype="bf16", attention="topk", heads=12, tokens=197,
                                                         head_dim=64, kernel="masked_sdpa")))
    assert attention_choice.topk_masked_shapes(torch.bfloat16, 197, 64) == [12]
    assert attention_choice.topk_masked_shapes(torch.float32, 197, 64) == []  # fp32 TopK runs the fused kernels
    assert attention_choice.topk_kernel_for(torch.empty(2, 12, 197, 64)) == "fused"


def test_a_shape_where_pytorchs_pick_was_measured_fastest_is_said_so():
    said = attention_choice.describe({(12, 50, 64): "pytorch"}, [(12, 50, 64), (16, 197, 32)])
    assert said == "12x50x64 PyTorch's pick (measured fastest); 16x197x32 PyTorch's pick (not measured)"
