"""A worker extension for the oracle tests: what vLLM's own loaders put in each parameter.

``snapshot(hf_dir, out_dir)`` reloads the HF checkpoint in ``hf_dir`` with vLLM's own
``load_weights`` through its layerwise reload, and records every parameter in model
format: linear layers just before vLLM's CPU kernels repack them (their live weight
is empty afterwards), every other parameter as it is live afterwards, into ``out_dir/rank<r>.pt``.
"""

import glob
from typing import Any


class SnapshotExtension:
    model_runner: Any

    def snapshot(self, hf_dir: str, out_dir: str) -> str:
        import torch
        import vllm.model_executor.layers.utils as layer_utils
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.model
        names: dict[int, str] = {}
        for n, mod in model.named_modules():
            names.setdefault(id(mod), n)
        seen: dict[str, torch.Tensor] = {}
        original = layer_utils.dispatch_cpu_unquantized_gemm

        def spy(layer: Any, remove_weight: bool) -> Any:
            seen[names[id(layer)] + ".weight"] = layer.weight.detach().clone()
            return original(layer, remove_weight)

        layer_utils.dispatch_cpu_unquantized_gemm = spy
        try:
            initialize_layerwise_reload(model)
            weights: dict[str, torch.Tensor] = {}
            for f in sorted(glob.glob(hf_dir + "/*.safetensors")):
                weights.update(load_file(f))
            model.load_weights(iter(weights.items()))
            finalize_layerwise_reload(model, self.model_runner.model_config)
        finally:
            layer_utils.dispatch_cpu_unquantized_gemm = original
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, t in seen.items():
            if n in out:
                out[n] = t
        from vllm.distributed.parallel_state import get_tp_group

        path = f"{out_dir}/rank{get_tp_group().rank_in_group}.pt"
        torch.save(out, path)
        return path
