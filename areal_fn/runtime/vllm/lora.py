"""A LoRA adapter alone into a running vLLM, by a PEFT directory vLLM loads in place.

::

    sync = VllmLoraSync(llm, root, model, config)      # llm: vllm.LLM(enable_lora=True)
    report = sync.update(version, adapters)             # adapters: PEFT's names, float32
    llm.generate(prompts, params, lora_request=sync.lora_request)

vLLM 0.32 serves adapters it reads from a PEFT directory (``adapter_config.json``,
``adapter_model.safetensors``) named by a ``LoRARequest``. An update:

1. writes the adapters as a PEFT directory
   (:func:`~areal_fn.runtime.hf.peft_io.write_peft_adapter`: a temporary directory
   renamed to ``<root>/<name>/v<version>`` once complete, so vLLM never reads one in
   part);
2. asks vLLM to load it under the adapter's one name and id with ``load_inplace``
   (``LLMEngine.add_lora``): every worker reads the directory (the path must be
   visible to every vLLM rank), vLLM's loaders cut each rank's part, and the new
   weights replace the old ones in the adapter's slot. A refused directory (vLLM
   validates it first) leaves the previous version served, but what vLLM's workers
   would refuse (LoRA off, a rank over ``max_lora_rank``) is refused here first, and so
   are adapters on routed experts (``target_parameters``: vLLM 0.32's CPU build has no
   kernel that runs LoRA on MoE experts): at
   TP > 1 a refusal inside the workers leaves vLLM's replies to later calls out of step;
3. removes the previous version's directory.

A new directory per version, not the same one rewritten, because vLLM's prefix cache
keys the blocks of an adapter's requests by the adapter's name and path: a path reused
would let requests hit blocks computed with the previous weights.

The bytes moved are the adapters' once (``bytes_written``: the tensor payload of the
file written); ``lower_bound`` is the adapters' size from the configuration alone. The
base weights do not move; a merged update goes through
:class:`~areal_fn.runtime.vllm.trainer.VllmWeightSync` with
:func:`~areal_fn.plans.lora_export.merge_lora`'s tensors.
"""

import os
import shutil
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from torch import Tensor

from areal_fn.errors import PlanError
from areal_fn.model.lora import LoraConfig, LoraError, lora_targets, lora_tensors
from areal_fn.model.spec import ModelSpec
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.plans.lora_export import ADAPTER_WEIGHTS
from areal_fn.runtime.hf.peft_io import write_peft_adapter
from areal_fn.runtime.vllm.deployment import VllmError

__all__ = ["VllmLoraReport", "VllmLoraSync", "safetensors_payload_bytes"]


def safetensors_payload_bytes(file: Path) -> int:
    """The tensor bytes of a safetensors file: its size less its header."""
    with open(file, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return os.path.getsize(file) - 8 - int(header)


def _refuse_experts(config: LoraConfig) -> None:
    if config.target_parameters:
        raise LoraError(
            f"LoraConfig.target_parameters={list(config.target_parameters)}: adapters on "
            "routed experts are not synced into vLLM: vLLM 0.32's CPU build cannot serve "
            "LoRA on MoE experts (PunicaWrapperCPU leaves the fused-MoE LoRA ops "
            "unimplemented; its LoRA-capable MoE kernels are Triton's and TensorRT-LLM's, "
            "GPU only); sync the merged weights (merge_lora with VllmWeightSync) or drop "
            "target_parameters"
        )


def _check_lora_config(llm: Any, model: ModelSpec, config: LoraConfig) -> None:
    """Refuse, before anything is written or sent, what vLLM's workers would refuse.

    A refusal inside the workers is worse than an error: vLLM 0.32's multiprocess
    executor reads its workers' replies to a call in rank order and stops at the first
    failure, so at TP > 1 the later workers' failure replies stay queued and answer the
    next calls (the next adapter update fails with the previous refusal).
    """
    lora = llm.llm_engine.vllm_config.lora_config
    if lora is None:
        raise PlanError(
            "this vLLM was started without LoRA; start it with enable_lora=True and "
            "max_lora_rank >= the adapter's ranks"
        )
    ranks = {t.module: t.rank for t in lora_targets(model, config)}
    wide = {m: r for m, r in sorted(ranks.items()) if r > lora.max_lora_rank}
    if wide:
        raise LoraError(
            f"adapter ranks {wide} exceed this vLLM's max_lora_rank={lora.max_lora_rank}; "
            "start vLLM with max_lora_rank >= "
            f"{max(wide.values())} (one of 1, 8, 16, 32, 64, 128, 256, 320, 512) or train "
            "a smaller rank"
        )


@attrs.frozen(kw_only=True)
class VllmLoraReport:
    """One adapter update."""

    version: int
    #: the directory vLLM loaded
    path: str
    #: the adapters' tensor bytes written (once, whatever vLLM's TP)
    bytes_written: int
    #: the adapters' bytes from the configuration alone (``r * (in + out)`` float32 each)
    lower_bound: int
    #: writing the directory, vLLM loading it, and the whole update
    write_seconds: float
    load_seconds: float
    seconds: float


class VllmLoraSync:
    """Serve a trainer's adapter in an offline ``vllm.LLM`` started with
    ``enable_lora=True`` and ``max_lora_rank`` at least the adapter's ranks (see the
    module doc). One adapter: ``name`` under vLLM id ``lora_id``."""

    def __init__(
        self,
        llm: Any,
        root: Path,
        model: ModelSpec,
        config: LoraConfig,
        *,
        name: str = "areal_fn",
        lora_id: int = 1,
        base_model: str | None = None,
    ) -> None:
        _refuse_experts(config)
        if type(llm).__name__ != "LLM" or not hasattr(llm, "llm_engine"):
            raise PlanError(
                f"VllmLoraSync takes an offline vllm.LLM started with enable_lora=True, not "
                f"{type(llm).__name__}"
            )
        if not name or "/" in name or name.startswith("."):
            raise PlanError(f"adapter name={name!r} must be a plain directory name")
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            raise PlanError(f"lora_id={lora_id!r} must be an int >= 1 (vLLM's adapter id)")
        _check_lora_config(llm, model, config)
        self.llm = llm
        self.folder = Path(root) / name
        self.model, self.config = model, config
        self.name, self.lora_id, self.base_model = name, lora_id, base_model
        self.version: int | None = None
        self.path: Path | None = None
        self.lower_bound = sum(
            s.numel * torch_dtype(s.dtype).itemsize for s in lora_tensors(model, config)
        )

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` to generate with (the version last loaded)."""
        if self.path is None:
            raise PlanError("no adapter version is loaded yet: call update(version, adapters)")
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_id, str(self.path))

    def update(self, version: int, adapters: Mapping[str, Tensor]) -> VllmLoraReport:
        """Write ``adapters`` as ``version`` and have vLLM serve them (see the module)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise PlanError(f"version={version!r} must be a non-negative int")
        if self.version is not None and version <= self.version:
            raise PlanError(
                f"version={version} is not newer than the served version {self.version}; "
                "versions must increase"
            )
        t0 = time.perf_counter()
        path = self.folder / f"v{version}"
        write_peft_adapter(
            path,
            adapters,
            model=self.model,
            config=self.config,
            base_model_name_or_path=self.base_model,
            overwrite=True,  # a version left by an earlier run (PEFT's files only)
        )
        written = safetensors_payload_bytes(path / ADAPTER_WEIGHTS)
        t1 = time.perf_counter()
        from vllm.lora.request import LoRARequest

        request = LoRARequest(self.name, self.lora_id, str(path), load_inplace=True)
        try:
            self.llm.llm_engine.add_lora(request)
        except Exception as e:
            shutil.rmtree(path, ignore_errors=True)
            raise VllmError(
                f"vLLM refused adapter version {version} at {path}: {e}; the previous version "
                "stays served, but at TP > 1 vLLM 0.32 answers later calls with the other "
                "workers' queued replies to this one: restart vLLM before the next update"
            ) from e
        t2 = time.perf_counter()
        previous, self.path, self.version = self.path, path, version
        if previous is not None and previous != path:
            shutil.rmtree(previous, ignore_errors=True)
        return VllmLoraReport(
            version=version,
            path=str(path),
            bytes_written=written,
            lower_bound=self.lower_bound,
            write_seconds=t1 - t0,
            load_seconds=t2 - t1,
            seconds=time.perf_counter() - t0,
        )
