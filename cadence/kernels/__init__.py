"""The CPU's C kernels: sources, build, and their ctypes bindings, in one place.

    csrc/                 the C sources (one library per ``<name>.c``; shared ``common.h``)
    build.py              compile on first use into a cache keyed by sources, flags and CPU;
                          ``load(name, march)`` -> ctypes library, or None (PyTorch fallback)
    paged_attention.py    ``paged_attention(march)`` -> attention of short queries over
                          the paged KV cache
    fused_ops.py          ``fused_ops(march)`` -> the decoder layer's elementwise steps
                          (add + RMSNorm, rotary, SiLU-mul)

Which of them a model runs is decided in ``cadence.runner.cpu_paths`` from
the CPU's probed features; nothing here assumes a CPU.
"""
