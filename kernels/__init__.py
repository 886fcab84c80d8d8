"""Layer 4's leaves: custom Triton kernels for the decoder and C++ CPU kernels, each beside the
plain-torch reference that defines it.

`kernels.ops.select_ops(device)` picks the implementation a model uses. The C++ sources live in
kernels/csrc and build as one extension (`kernels.cpu_extension`); `kernels.timing` is the timing helper
every benchmark uses. The benchmarks themselves live in benchmarks/ (`kernel_bench.py` measures the
kernels against eager and compiled torch; `kernel_compile_check.py` compiles them for a CUDA target
without a GPU).
"""
