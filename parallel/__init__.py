"""Layer 2, parallelism: tensor parallelism applied from outside the model.

The decoder (`model/llama.py`) stays single-device code. `shard.py` slices a loaded model's weights
Megatron style (column-parallel q/k/v and gate/up, row-parallel o and down followed by an all-reduce,
vocabulary-parallel embedding and LM head), `worker.py` runs ranks 1..N-1 in their own processes, and
`TensorParallelModel` is the `StepModel` the engine drives on rank 0. Mixture-of-experts layers are split
by experts (expert parallelism), their partial outputs summed by the same all-reduce.
"""

from parallel.errors import TensorParallelError
from parallel.layout import TensorParallelLayout

__all__ = ["TensorParallelError", "TensorParallelLayout"]
