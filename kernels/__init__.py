"""Custom Triton kernels for the decoder, each beside the plain-torch reference that defines it.

`kernels.ops.select_ops(device)` picks the implementation a model uses; `python -m kernels.bench`
measures them against eager and compiled torch; `python -m kernels.compile_check` compiles them for a
CUDA target without a GPU.
"""
