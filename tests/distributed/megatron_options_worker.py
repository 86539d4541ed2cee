"""torchrun worker (4 ranks, gloo): one ``MegatronEngine`` step under each run option
against the same step without it. Run by ``test_megatron_options.py``.

Every case builds the engine of its model under ``megatron:d2p2`` (1F1B over 4
micro-batches of one row per data-parallel share), loads the same canonical weights,
takes one ``train_step`` on the same rows, and records on every rank: the loss, the
gradient norm, the largest difference of its local gradients and of its weights after the
step from the case without options (bitwise expected: recompute runs the same kernels
again, and a two-rank all-reduce sums the same two numbers in any bucketing), the peak
bytes of activations saved for backward (``saved_tensors_hooks``: storages alive at once,
parameters not counted), and how many gradient all-reduces were started asynchronously
while backward ran (the overlap), in each of two steps. Rank ``r`` writes
``<out>/rank<r>.json``.
"""

import argparse
import json
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.model.spec import model_from_hf_config  # noqa: E402
from areal_fn.runtime.engines.common import split_rows  # noqa: E402
from areal_fn.runtime.engines.megatron import MegatronEngine  # noqa: E402
from areal_fn.runtime.engines.megatron_options import MegatronRunOptions  # noqa: E402
from areal_fn.strategy.parse import parse_allocation  # noqa: E402
from tests.distributed.grad_worker import ADAMW, CONFIGS, unexplained_weight_diff  # noqa: E402

STRATEGY = "megatron:d2p2"
Opt = MegatronRunOptions
#: (case, model, options); each model's first case is its reference (no options).
CASES: tuple[tuple[str, str, MegatronRunOptions], ...] = (
    ("qwen2/none", "qwen2_4l", Opt()),
    (
        "qwen2/full-uniform-1",
        "qwen2_4l",
        Opt(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ),
    (
        "qwen2/full-block-1",
        "qwen2_4l",
        Opt(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    ),
    (
        "qwen2/selective",
        "qwen2_4l",
        Opt(recompute_granularity="selective", recompute_modules=("core_attn", "mlp", "layernorm")),
    ),
    ("qwen2/overlap", "qwen2_4l", Opt(overlap_grad_reduce=True, bucket_size=2000)),
    ("deepseek_v3/none", "deepseek_v3", Opt()),
    (
        "deepseek_v3/selective",
        "deepseek_v3",
        Opt(
            recompute_granularity="selective",
            recompute_modules=("core_attn", "mla_up_proj", "moe", "shared_experts", "layernorm"),
        ),
    ),
    (
        "deepseek_v3/full+overlap",
        "deepseek_v3",
        Opt(
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
            overlap_grad_reduce=True,
            bucket_size=500,
        ),
    ),
)


class SavedBytes:
    """Peak bytes of the storages saved for backward that are alive at once."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def pack(self, t: Tensor) -> Any:
        if t.is_leaf and t.requires_grad:  # a parameter: not an activation
            return t
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if self.live.get(key, 0) == 0:
            self.now += size
            self.peak = max(self.peak, self.now)
        self.live[key] = self.live.get(key, 0) + 1
        return (t, _Release(self, key, size))

    @staticmethod
    def unpack(packed: Any) -> Tensor:
        return packed if isinstance(packed, Tensor) else packed[0]


class _Release:
    def __init__(self, owner: SavedBytes, key: int, size: int) -> None:
        self.owner, self.key, self.size = owner, key, size

    def __del__(self) -> None:
        self.owner.live[self.key] -= 1
        if self.owner.live[self.key] == 0:
            self.owner.now -= self.size


@contextmanager
def async_reduces_in_backward() -> Iterator[list[int]]:
    """Counts ``all_reduce(async_op=True)`` calls made while autograd runs backward."""
    count = [0]
    original = dist.all_reduce

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op") and torch._C._current_graph_task_id() != -1:
            count[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = all_reduce  # type: ignore[assignment]
    try:
        yield count
    finally:
        dist.all_reduce = original


def weights(spec: Any, seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        t.name: (1.0 if t.name.endswith("norm.weight") else 0.0)
        + 0.1 * torch.randn(t.shape, generator=gen)
        for t in spec.tensors
    }


def run_case(model: str, options: MegatronRunOptions) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Two steps; saved bytes in the first, async reduces in each (Megatron's DDP starts
    them in backward from the second step on: the first records the order grads come)."""
    spec = model_from_hf_config(CONFIGS[model])
    ids = torch.randint(0, spec.vocab_size, (8, 16), generator=torch.Generator().manual_seed(3))
    dims = parse_allocation(STRATEGY).training
    record: dict[str, Any] = {"loss": [], "grad_norm": [], "async_reduces_in_backward": []}
    tensors: dict[str, Tensor] = {}
    with MegatronEngine(spec, dims, optimizer=ADAMW, run_options=options) as engine:
        engine.load_canonical(weights(spec, 0))
        rows = split_rows(ids, engine.dp_size, engine.dp_rank)
        for step in (1, 2):
            saved = SavedBytes()
            with (
                async_reduces_in_backward() as reduces,
                torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack),
            ):
                stats = engine.train_step(rows)
            record["loss"].append(stats["loss"])
            record["grad_norm"].append(stats["grad_norm"])
            record["async_reduces_in_backward"].append(reduces[0])
            record.setdefault("saved_peak", saved.peak)
            for k, v in engine.local_grads().items():
                if v is not None:
                    tensors[f"g{step}.{k}"] = v.clone()
            tensors.update({f"w{step}.{k}": v.clone() for k, v in engine.local_state().items()})
    return record, tensors


def max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max((float((a[k] - b[k]).abs().max()) for k in a if a[k].numel()), default=0.0)


def _of(tensors: dict[str, Tensor], kind: str) -> dict[str, Tensor]:
    return {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(kind + ".")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    records: dict[str, Any] = {}
    reference: dict[str, dict[str, Tensor]] = {}
    for case, model, options in CASES:
        try:
            record, tensors = run_case(model, options)
            if model not in reference:
                reference[model] = tensors
            ref = reference[model]
            for kind in ("g1", "w1", "g2", "w2"):
                record[f"{kind}_diff"] = max_diff(_of(tensors, kind), _of(ref, kind))
            trained = _of(ref, "g1").keys()  # not the routers' expert-bias buffers
            record["w1_unexplained"] = unexplained_weight_diff(
                {k: v for k, v in _of(tensors, "w1").items() if k in trained},
                {k: v for k, v in _of(ref, "w1").items() if k in trained},
                _of(ref, "g1"),
                record["g1_diff"],
            )
        except Exception:  # recorded; the launch goes on to the next case
            record = {"error": traceback.format_exc()}
        records[case] = record
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(records, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
