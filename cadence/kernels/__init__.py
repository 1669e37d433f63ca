"""The CPU's kernels: C sources, build, their ctypes bindings, oneDNN's packed matmuls.

    csrc/                 the C sources (one library per ``<name>.c``; shared ``common.h``)
    build.py              compile on first use into a cache keyed by sources, flags and CPU;
                          ``load(name, march)`` -> ctypes library, or None (PyTorch fallback)
    paged_attention.py    ``paged_attention(march)`` -> attention of short queries over
                          the paged KV cache
    fused_ops.py          ``fused_ops(march)`` -> the decoder layer's elementwise steps
                          (add + RMSNorm, rotary, SiLU-mul)
    quant_matmul.py       ``quant_matmul(march)`` -> ``x @ W^T`` with W kept in GGUF blocks
                          (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K,
                          Q6_K, IQ4_NL, IQ4_XS), and embedding rows decoded
    packed_weights.py     matmul weights in oneDNN's packed layout (``torch.ops.mkldnn``),
                          with the probe of whether this CPU packs a dtype

Which of them a model runs is decided in ``cadence.runner.cpu_paths`` from
the CPU's probed features; nothing here assumes a CPU.
"""
