"""Registers / spills / shared memory of the kernels as launched on this GPU (Triton's own compile
on the device), beside kernels/compile_check.py's ahead-of-time numbers for sm_90.
usage: python benchmarks/h100_20261124/device_regs.py OUT_JSON"""
import json, sys, torch
sys.path.insert(0, ".")
import kernels.restricted_triton as rt
from kernels.compile_check import compile_one, Shape
rows = []
for (T, d) in [(197, 64), (257, 80)]:
    for dtype in (torch.float16, torch.bfloat16):
        for fn in (rt._threshold_kernel, rt._fwd_kernel, rt._bwd_dkdv_kernel, rt._bwd_dq_kernel):
            fn.device_caches.clear()  # only this shape's compiles are read below
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(2, 4, T, d, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(3))
        seg = torch.zeros(2, T, dtype=torch.long, device="cuda"); seg[:, 0] = -1
        out, _ = rt.topk_attention(q, k, v, torch.full((2, T), 49, device="cuda"), 1, seg)
        out.sum().backward(); torch.cuda.synchronize()
        for name, fn in [("threshold", rt._threshold_kernel), ("forward", rt._fwd_kernel), ("dkdv", rt._bwd_dkdv_kernel), ("dq", rt._bwd_dq_kernel)]:
            for entry in fn.device_caches.values():
                for compiled in entry[0].values():
                    compiled._init_handles()
                    row = {"T": T, "d": d, "dtype": str(dtype)[6:], "kernel": name, "device_regs": compiled.n_regs,
                           "device_spills": compiled.n_spills, "device_shared": compiled.metadata.shared}
                    b = compile_one(Shape("x", T, d), {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype], "topk", name, 90)
                    row.update(aot_regs=b.registers, aot_spills=b.spills, aot_shared=b.shared)
                    rows.append(row); print(row)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
