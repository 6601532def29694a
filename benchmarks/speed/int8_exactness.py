"""Are torch's int8 matrix products exact on this CPU? (memlm.models.int8.int8_products_exact)

Multiplies ±127 int8 matrices (512 terms per sum) with ``torch._int_mm`` and compares with int64 arithmetic. Run it
as is, with torch held to AVX2 (the proxy for a CPU without AVX-512 or VNNI), and held to AVX2 with AVX-VNNI (the
proxy for a CPU with AVX-VNNI but no AVX-512 or bf16, as Intel's 12th-14th generation Core):

    PYTHONPATH=src python benchmarks/speed/int8_exactness.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
      PYTHONPATH=src python benchmarks/speed/int8_exactness.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2_VNNI MKL_ENABLE_INSTRUCTIONS=AVX2_E1 \\
      PYTHONPATH=src python benchmarks/speed/int8_exactness.py
"""

import os

import torch

from memlm.models.int8 import int8_products_exact

g = torch.Generator().manual_seed(0)
a = (torch.randint(0, 2, (64, 512), generator=g) * 254 - 127).to(torch.int8)
b = (torch.randint(0, 2, (96, 512), generator=g) * 254 - 127).to(torch.int8)
got, want = torch._int_mm(a, b.t()).long(), a.long() @ b.long().t()
print(
    {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")},
    "cpu capability",
    torch.backends.cpu.get_cpu_capability(),
    "| int8_products_exact:",
    int8_products_exact(),
    "| wrong entries:",
    int((got != want).sum()),
    "of",
    want.numel(),
    "| largest error:",
    int((got - want).abs().max()),
)
