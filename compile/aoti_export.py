"""The AOTInductor package of a CPU `torch-compile` artifact (`engine/backends/aoti_runtime.py` loads it).

`export_package` takes the module exactly as the runtime rebuilds it from the artifact's files, exports
one engine step (`PackagedStep`: flat tensor arguments, the attention as the `ladder::paged_attention`
custom op writing the caches in place) with `torch.export`, every batch dimension dynamic, and has
AOTInductor compile it into `step.pt2`: generated C++ and one shared library, no weights (the runtime hands
it the module's tensors by name) and nothing pickled. Done once here, so serving never compiles.
"""

from __future__ import annotations

from pathlib import Path

import torch

from compile.onnx_export import example_step
from engine.backends.aoti_runtime import PACKAGE, STEP_ARGS, PackagedStep
from model.attention import OpaquePagedAttention, install
from model.llama import LlamaForCausalLM

# The weights stay out of the library: the runtime passes the module's own (user-managed) tensors.
INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False,
                    "aot_inductor.package_constants_on_disk_format": None}


def dynamic_shapes(num_layers: int) -> tuple:
    """Every batch dimension dynamic (T tokens, S sequences, the plan's widths); one symbol for the number
    of cache blocks, shared by every layer's cache [2, num_blocks, block_size, kv_heads, head_dim]."""
    dynamic = torch.export.Dim.DYNAMIC
    dims = {
        "input_ids": {0: dynamic}, "positions": {0: dynamic}, "query_index": {0: dynamic, 1: dynamic},
        "output_index": {0: dynamic}, "block_tables": {0: dynamic, 1: dynamic},
        "mask": {0: dynamic, 2: dynamic, 3: dynamic}, "slot_mapping": {0: dynamic}, "seq_lens": {0: dynamic},
        "sample_rows": {0: dynamic},
    }
    num_blocks = torch.export.Dim("num_blocks")
    # forward(*step, *kv_caches): the varargs take one entry, a tuple with one spec per cache.
    return (*(dims[name] for name in STEP_ARGS), tuple({1: num_blocks} for _ in range(num_layers)))


def export_package(module: LlamaForCausalLM, directory: Path, kv_cache_dtype: torch.dtype) -> list[str]:
    """Compile one step of `module` (CPU, in its final precision) into `directory / step.pt2`; returns the
    file's name. The module's attention is set to the opaque custom op, as the runtime sets it."""
    if module.device.type != "cpu":
        raise ValueError(f"the AOTInductor package is built for CPU modules, not {module.device.type}")
    install(module, OpaquePagedAttention(module.block_size, module.config.sliding_window))
    # A small mixed batch (a prefill chunk beside a decode): no dimension is 0 or 1, which the exporter
    # would specialise; the compiled step then serves any size.
    args, caches = example_step(module.config, module.block_size, num_blocks=8, dtype=kv_cache_dtype)
    with torch.no_grad():
        program = torch.export.export(PackagedStep(module).eval(), (*args, *caches),
                                      dynamic_shapes=dynamic_shapes(module.config.num_layers))
        torch._inductor.aoti_compile_and_package(program, package_path=str(Path(directory) / PACKAGE),
                                                 inductor_configs=INDUCTOR_CONFIGS)
    return [PACKAGE]
