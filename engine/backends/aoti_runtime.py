"""A CPU `torch-compile` artifact's step as an AOTInductor package: compiled once by `ladder compile`,
loaded at start-up in about a second instead of compiled again by Inductor.

The package (`step.pt2`, written by `compile/aoti_export.py`) holds the C++ code and shared library
Inductor generated for one engine step of the artifact's module (`PackagedStep` below), with every batch
dimension dynamic. It holds no weights and nothing pickled: the weights come from the artifact's
`model.safetensors`, rebuilt into the same module as the `torch.compile` path builds, and are handed to
the library by name (`load_constants`, user-managed: the library reads the module's own tensors, so they
are in memory once). The KV caches are step inputs, written in place by the attention custom op.

Custom ops (`ladder::paged_attention`, `ladder::int8_linear`, `ladder::w8a8_linear`) are called by the
library through AOTInductor's proxy executor, that is through torch's dispatcher, so they must be
registered (their Python modules imported) before the package is loaded; importing this module does that.

Generated code is tied to the torch that generated it and to the CPU's vector instructions, so the
manifest records both (`package_record`) and loading refuses a mismatch with one line (`check_package`).
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.backends.manifest import ArtifactError
from kernels import cpu_int8_linear, cpu_w8a8_linear  # noqa: F401  registers ladder::int8_linear, w8a8_linear
from kernels.cpu_extension import cpu_flags
from model.attention import OpaquePagedAttention, TorchAttentionPlan, install
from model.llama import LlamaForCausalLM
from model.quantization import activation_dtype
from model.step import BaseStepModel, allocate_kv_caches

PACKAGE = "step.pt2"
KIND = "aotinductor"
# The step's tensor arguments in the library's order; the per-layer KV caches follow them.
STEP_ARGS = ("input_ids", "positions", "query_index", "output_index", "block_tables", "mask", "slot_mapping",
             "seq_lens", "sample_rows")
# Vector extensions Inductor's generated CPU code (and torch's kernels) may use; the package needs those
# of the machine that built it. Listed by their /proc/cpuinfo names.
VECTOR_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")


class PackagedStep(nn.Module):
    """One engine step with flat tensor arguments (what is exported and compiled): writes the step's K/V
    into the caches in place and returns logits [B, vocab] float32 of the sampled rows."""

    def __init__(self, module: LlamaForCausalLM) -> None:
        super().__init__()
        self.module = module

    def forward(self, input_ids, positions, query_index, output_index, block_tables, mask, slot_mapping,
                seq_lens, sample_rows, *kv_caches):
        plan = TorchAttentionPlan(query_index, output_index, block_tables, mask, slot_mapping, seq_lens)
        return self.module.sample_logits(input_ids, positions, list(kv_caches), plan, sample_rows)


def cpu_vector_flags() -> list[str]:
    """This CPU's vector extensions among VECTOR_FLAGS (empty where /proc/cpuinfo is not readable)."""
    return [flag for flag in VECTOR_FLAGS if flag in cpu_flags()]


def package_record() -> dict[str, Any]:
    """What the manifest says of the package: its file and what it was built for."""
    return {"file": PACKAGE, "kind": KIND, "torch": torch.__version__, "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": cpu_vector_flags()}


def check_package(record: dict[str, Any]) -> None:
    """Refuse, with one line, a package built by another torch or for vector instructions this CPU lacks."""
    if record.get("kind") != KIND:
        raise ArtifactError(f"compiled step of unknown kind {record.get('kind')!r} (this ladder reads {KIND})")
    if record.get("torch") != torch.__version__:
        raise ArtifactError(f"compiled step built with torch {record.get('torch')}, this is torch "
                            f"{torch.__version__}: recompile the artifact (ladder compile) with this torch")
    missing = sorted(set(record.get("cpu_flags", [])) - set(cpu_vector_flags()))
    if record.get("machine") != platform.machine() or missing:
        raise ArtifactError(f"compiled step built for a {record.get('machine')} CPU with "
                            f"{' '.join(record.get('cpu_flags', [])) or 'no listed vector extensions'}; this "
                            f"{platform.machine()} CPU lacks {' '.join(missing) or 'that architecture'}: "
                            "recompile the artifact on this machine")


class PackagedModel(BaseStepModel):
    """An AOTInductor package of the step over the rebuilt module's weights, as a StepModel (model/step.py)."""

    def __init__(self, package: Path, module: LlamaForCausalLM, precision: str) -> None:
        self.module = module
        self.config = module.config
        self.block_size = module.block_size
        self.precision = precision
        self.device = module.device
        self.kv_cache_dtype = activation_dtype(precision, self.device)
        # The attention the package was compiled with (a call to the custom op, not its body); its plan()
        # builds the step's attention tensors.
        self.attention = OpaquePagedAttention(module.block_size, module.config.sliding_window)
        install(module, self.attention)
        try:
            # The package's C++ loader itself (not `aoti_load_package`, whose Python side may read pickled
            # parts of a .pt2 archive): it unpacks and opens the shared library only.
            self._loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
        except RuntimeError as exc:
            reason = " ".join(str(exc).split())[:200]
            raise ArtifactError(f"{package}: cannot load the compiled step: {reason}") from exc
        # The library names each weight by its path in PackagedStep ("module.<name>").
        tensors = {**dict(module.named_parameters(remove_duplicate=False)),
                   **dict(module.named_buffers(remove_duplicate=False))}
        wanted = self._loader.get_constant_fqns()
        unknown = [name for name in wanted if name.removeprefix("module.") not in tensors]
        if unknown:
            raise ArtifactError(f"{package}: the compiled step needs weights the artifact lacks: {unknown[:3]}")
        self._constants = {name: tensors[name.removeprefix("module.")] for name in wanted}
        self._loader.load_constants(self._constants, False, True, True)  # user-managed: no copy

    def warm_up(self, kv_caches: list[torch.Tensor]) -> None:
        """Nothing left to warm: `torch_compiled.load` ran its warm-up steps."""

    def plan(self, meta) -> TorchAttentionPlan:
        return self.attention.plan(meta)

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        return allocate_kv_caches(self.config, self.block_size, num_blocks, self.kv_cache_dtype, self.device)

    def sample_logits(self, input_ids, positions, kv_caches, plan: TorchAttentionPlan, sample_rows) -> torch.Tensor:
        args = [input_ids, positions, plan.query_index, plan.output_index, plan.block_tables, plan.mask,
                plan.slot_mapping, plan.seq_lens, sample_rows, *kv_caches]
        return self._loader.boxed_run(args)[0]
