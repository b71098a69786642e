"""Device A/B: the fused restricted-attention kernels of another version (old: a copy of its
kernels/restricted_triton.py) against this checkout's (new), beside the PyTorch composition and
dense SDPA, forward+backward, same inputs, alternating.
usage: python benchmarks/h100_20261124/kernel_ab.py OUT_JSON OLD_RESTRICTED_TRITON_PY"""
import importlib.util, json, sys, torch, triton
import torch.nn.functional as F
from triton.testing import do_bench
sys.path.insert(0, ".")
import kernels.restricted_triton as new
from kernels.masked import TopKMask, topk_attention_reference, segment_attention_sdpa, GLOBAL
spec = importlib.util.spec_from_file_location("old_rt", sys.argv[2])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
rows = []
for (B, H, T, d) in [(128, 12, 197, 64), (128, 16, 197, 64), (64, 16, 257, 80), (32, 12, 577, 64)]:
    for dtype in (torch.bfloat16, torch.float16):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, T, d, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(3))
        seg = torch.randint(0, 4, (B, T), device="cuda", generator=g); seg[:, 0] = GLOBAL
        kr = torch.full((B, T), round(0.25 * (T - 1)), device="cuda")
        do = torch.randn_like(q)
        def fb(fn):
            def run():
                out = fn(); torch.autograd.grad(out, (q, k, v), do)
            return run
        variants = {
            "dense_sdpa": fb(lambda: F.scaled_dot_product_attention(q, k, v)),
            "topk_torch": fb(lambda: topk_attention_reference(q, k, v, TopKMask(kr, segments=None))),
            "topk_new": fb(lambda: new.topk_attention(q, k, v, kr, 1, seg)[0]),
            "segment_sdpa": fb(lambda: segment_attention_sdpa(q, k, v, seg)),
            "segment_new": fb(lambda: new.segment_attention(q, k, v, seg)),
        }
        if old.supports(q) is None:
            variants["topk_old"] = fb(lambda: old.topk_attention(q, k, v, kr, 1, seg)[0])
            variants["segment_old"] = fb(lambda: old.segment_attention(q, k, v, seg))
        res = {}
        for rep in range(2):  # alternate
            for name, fn in variants.items():
                try:
                    ms = do_bench(fn, warmup=10, rep=60)
                except Exception as e:
                    ms = None; res[name + "_error"] = str(e)[:200]
                res.setdefault(name, []).append(ms)
        res = {k: (min(x for x in v if x is not None) if isinstance(v, list) and any(x is not None for x in v) else v) for k, v in res.items()}
        row = {"shape": [B, H, T, d], "dtype": str(dtype).split(".")[-1], "ms_fwd_bwd": res}
        print(json.dumps(row)); rows.append(row)
        del q, k, v, do; torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "rows": rows},
          open(sys.argv[1], "w"), indent=1)
