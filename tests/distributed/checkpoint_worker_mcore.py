"""torchrun worker (2 ranks, gloo, CPU): Megatron-Core's own checkpoints in and out.

Dense (the first case, ``dense``):

1. Megatron-Core builds a ``GPTModel`` under tp=2 (CPU, local spec), holding known
   canonical weights (placed with ``to_megatron``), and saves it with its own
   ``dist_checkpointing.save`` (``torch_dist`` backend).
2. Rank 0 imports that checkpoint into canonical space
   (:func:`import_megatron_checkpoint`): bitwise equal to the weights put in. It then
   exports the canonical weights (:func:`export_megatron_checkpoint`).
3. Megatron-Core builds the model under pp=2 and loads the export with its own
   ``dist_checkpointing.load``: every parameter bitwise equal to what ``to_megatron``
   makes of the weights for that rank.

MoE (``MOE_CASES``: qwen3_moe with every layer MoE, so layers stacked; qwen3_moe and
glm4_moe with dense layers, so per-layer keys; glm4_moe has a shared expert and expert
bias): the same three steps, Megatron saving under ep=2 and loading our export
(``layer_spec="local"``, the spec built here) under other EP/ETP strategies.

The CLI's checkpoints (``--cli SPEC.json``, written by the installed ``areal-fn convert
... --format torch_dist`` from a ``transformers`` checkpoint): the directory Megatron-LM's
``--load OUT`` reads is found by Megatron-LM's rules (:func:`megatron_lm_load_dir`), and
Megatron-Core loads it under the allocation it was written for and under another; every
parameter bitwise equal to ``to_megatron`` of the HF weights (read with
:class:`HfCheckpoint`).

Megatron's ``torch_dist`` writer logs the process memory through ``psutil`` (in the dev
extra); where psutil is missing the worker stubs that logging probe (it only feeds a
debug message). Results: ``<out>/rank<r>.json`` ``{"checks": {name: problem or ""}}``.
"""

import argparse
import json
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.layouts.megatron import megatron_layout  # noqa: E402
from areal_fn.layouts.vocab import padded_vocab_size  # noqa: E402
from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402
from areal_fn.plans.convert import to_megatron  # noqa: E402
from areal_fn.runtime.checkpoint.api import (  # noqa: E402
    export_megatron_checkpoint,
    import_megatron_checkpoint,
)
from areal_fn.runtime.megatron.build import (  # noqa: E402
    MegatronSizes,
    build_gpt_model,
    megatron_session,
    transformer_config,
)
from areal_fn.strategy.allocation import ParallelDims  # noqa: E402
from tests.distributed.checkpoint_worker_util import bits, model  # noqa: E402
from tests.distributed.conversion_worker import FAMILIES, sizes_of  # noqa: E402
from tests.distributed.conversion_worker import arch_of as family_arch  # noqa: E402

SPEC = model(torch_dtype="float32", tie_word_embeddings=False)
VOCAB_PADDED = padded_vocab_size(SPEC.vocab_size, tp=2)  # 256: both strategies below

#: strategies of 2 ranks (ParallelDims fields)
DIMS: dict[str, dict[str, int]] = {
    "t1": {"dp": 2},
    "t2": {"tp": 2},
    "p2": {"pp": 2},
    "e2": {"dp": 2, "ep": 2},
    "t2-moe": {"tp": 2, "etp": 2},
    "t2e2": {"tp": 2, "ep": 2, "etp": 1},
}
#: vocab 250: Megatron pads it to 256 under tp=1 and tp=2 alike, so one checkpoint
#: fits the models of every strategy below (a padded vocabulary is part of the shapes)
VOCAB = {"vocab_size": 250}
#: (name, family config, Megatron saves under, Megatron loads our export under)
MOE_CASES: list[tuple[str, dict[str, Any], str, tuple[str, ...]]] = [
    (
        "qwen3_moe stacked",
        {**FAMILIES["qwen3_moe"], **VOCAB, "mlp_only_layers": []},
        "e2",
        ("t2-moe", "t2e2"),
    ),
    ("qwen3_moe per-layer", {**FAMILIES["qwen3_moe"], **VOCAB}, "e2", ("t2-moe", "p2")),
    ("glm4_moe per-layer", {**FAMILIES["glm4_moe"], **VOCAB}, "e2", ("t2e2",)),
    ("deepseek_v3 per-layer", {**FAMILIES["deepseek_v3"], **VOCAB}, "e2", ("t2-moe",)),
    ("mixtral stacked", {**FAMILIES["mixtral"], **VOCAB}, "e2", ("t2e2",)),
]
#: the key Megatron-Core's DistributedOptimizer gives its per-bucket state (its
#: ``sharded_state_dict``, ``dp_reshardable``); the optimizer cannot be built on CPU
OPTIMIZER_KEY = "optimizer.distributed.dp_group_idx_0.param_state"


def arch(spec: ModelSpec) -> dict[str, Any]:
    """The builder's architecture; MoE with every layer sparse as ``moe_layer_freq=1``
    (what Megatron-LM and Megatron-Bridge configure for such a model: layers stacked)."""
    a = family_arch(spec)
    if spec.is_moe and all(spec.moe_layers):
        a["moe_layer_pattern"] = None
    return a


def canonical(spec: ModelSpec, seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}


def stub_psutil_probe() -> None:
    """Only where psutil is missing (the dev extra installs it): Megatron's writer then
    cannot log its memory; stub that one log call."""
    import importlib.util

    if importlib.util.find_spec("psutil") is not None:
        return
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fa

    fa._process_memory = lambda: 0


def dims_of(name: str) -> ParallelDims:
    return ParallelDims(**DIMS[name])


def build(spec: ModelSpec, sizes: MegatronSizes, vocab: int) -> Any:
    config = transformer_config(arch(spec), sizes)
    return build_gpt_model(arch(spec), config, vocab_size=vocab)


def tensors_of(gpt: Any) -> dict[str, torch.Tensor]:
    """Parameters and buffers (a router's expert bias) of a built model, by name."""
    return {**dict(gpt.named_buffers()), **dict(gpt.named_parameters())}


def megatron_saves(
    spec: ModelSpec,
    truth: Mapping[str, torch.Tensor],
    strategy: str,
    vocab: int,
    dest: Path,
    *,
    optimizer: bool = False,
) -> None:
    """Megatron builds ``spec`` under ``strategy``, holding ``truth``, and saves it (with
    ``optimizer``, also an entry where the distributed optimizer keeps its state)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    dims = dims_of(strategy)
    with megatron_session(sizes_of(dims), seed=0):
        gpt = build(spec, sizes_of(dims), vocab)
        local = to_megatron(truth, megatron_layout(spec, dims), dist.get_rank())
        have = tensors_of(gpt)
        with torch.no_grad():
            for name, t in local.items():  # every layout tensor is the model's (KeyError)
                have[name].copy_(t)
        dest.mkdir(exist_ok=True)
        sharded = gpt.sharded_state_dict()
        if optimizer:
            state = {"step": 3, "buckets": [torch.zeros(4)]}
            replica = (0, 0, dist.get_rank())
            sharded["optimizer"] = ShardedObject(
                OPTIMIZER_KEY, state, (1,), (0,), replica_id=replica
            )
        dist.barrier()
        dist_checkpointing.save(sharded, str(dest))
        dist.barrier()


def megatron_loads(
    spec: ModelSpec,
    source: "Mapping[str, torch.Tensor] | Callable[..., torch.Tensor]",
    strategy: str,
    vocab: int,
    path: Path,
) -> str:
    """Megatron builds ``spec`` under ``strategy`` and loads ``path`` with its own
    loader, the model's state under ``model`` as Megatron-LM's ``load_checkpoint``
    asks (the common state lands beside it): "" when every tensor equals
    ``to_megatron(source)`` bitwise."""
    from megatron.core import dist_checkpointing

    dims = dims_of(strategy)
    with megatron_session(sizes_of(dims), seed=1):
        gpt = build(spec, sizes_of(dims), vocab)
        try:
            state = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, str(path))
            gpt.load_state_dict(state["model"])
            want = to_megatron(source, megatron_layout(spec, dims), dist.get_rank())
            have = tensors_of(gpt)
            bad = [
                n
                for n, w in want.items()
                if n not in have or not torch.equal(bits(have[n].detach()), bits(w))
            ]
            problem = f"differ: {bad[:4]}" if bad else ""
        except Exception:
            problem = traceback.format_exc()[-2000:]
        dist.barrier()
        return problem


def import_check(path: Path, spec: ModelSpec, truth: Mapping[str, torch.Tensor]) -> str:
    got = import_megatron_checkpoint(path, spec, trust_pickle=True)
    bad = [n for n in truth if n not in got or not torch.equal(bits(got[n]), bits(truth[n]))]
    return f"differ: {bad[:4]}" if bad or got.keys() != truth.keys() else ""


def round_trip(
    checks: dict[str, str],
    name: str,
    spec: ModelSpec,
    saves: str,
    loads: tuple[str, ...],
    out: Path,
    *,
    layer_spec: str,
    vocab: int,
) -> None:
    """Megatron saves under ``saves``; we import (rank 0) and export; Megatron loads
    the export under each of ``loads``."""
    truth = canonical(spec)
    tag = name.replace(" ", "_")
    megatron_saves(spec, truth, saves, vocab, out / f"mcore_{tag}")
    if dist.get_rank() == 0:
        key = f"{name}: import of a Megatron {saves} checkpoint"
        try:
            checks[key] = import_check(out / f"mcore_{tag}", spec, truth)
            export_megatron_checkpoint(
                truth, spec, out / f"ours_{tag}", vocab_size_padded=vocab, layer_spec=layer_spec
            )
        except Exception:
            checks[key] = traceback.format_exc()[-2000:]
    dist.barrier()
    for strategy in loads:
        checks[f"{name}: megatron loads the export under {strategy}"] = megatron_loads(
            spec, truth, strategy, vocab, out / f"ours_{tag}"
        )


def optimizer_checks(checks: dict[str, str], out: Path) -> None:
    """A Megatron checkpoint with optimizer state: refused, or imported without it."""
    from areal_fn.errors import CheckpointError

    truth = canonical(SPEC)
    megatron_saves(SPEC, truth, "t1", VOCAB_PADDED, out / "mcore_optim", optimizer=True)
    if dist.get_rank() != 0:
        return
    try:
        import_megatron_checkpoint(out / "mcore_optim", SPEC, trust_pickle=True)
        checks["optimizer state refused"] = "imported"
    except CheckpointError as e:
        want = f"holds optimizer state (1 entry, e.g. '{OPTIMIZER_KEY}/shard_0_1')"
        checks["optimizer state refused"] = "" if want in str(e) else str(e)
    got = import_megatron_checkpoint(
        out / "mcore_optim", SPEC, trust_pickle=True, drop_optimizer=True
    )
    bad = [n for n in truth if not torch.equal(bits(got[n]), bits(truth[n]))]
    checks["optimizer state dropped on request"] = f"differ: {bad[:4]}" if bad else ""


def megatron_lm_load_dir(root: Path) -> Path:
    """The directory Megatron-LM's ``--load root`` reads, by its rules
    (``megatron/training/checkpointing.py``): ``read_metadata`` of
    ``root/latest_checkpointed_iteration.txt`` (an iteration or ``release``; releases
    before November 2025 assert ``iteration > 0 or release``), ``get_checkpoint_name``
    (``release`` or ``iter_{iteration:07d}``), ``find_checkpoint_rank_0``
    (``check_is_distributed_checkpoint``); then what ``load_checkpoint`` takes from the
    common state: ``checkpoint_version`` (absent reads as 0, the pre-2.0 QKV order) and,
    for an iteration, ``iteration`` (else it exits unless ``--finetune``)."""
    from megatron.core import dist_checkpointing

    text = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    release = text == "release"
    iteration = 0 if release else int(text)
    if not (iteration > 0 or release):
        raise ValueError(f"tracker {text!r}: neither an iteration > 0 nor release")
    folder = root / ("release" if release else f"iter_{iteration:07d}")
    if not dist_checkpointing.check_is_distributed_checkpoint(str(folder)):
        raise ValueError(f"{folder} is not a Megatron-Core dist checkpoint")
    common = dist_checkpointing.load_common_state_dict(str(folder))
    if common.get("checkpoint_version", 0) < 2.0:
        raise ValueError(f"{folder}: checkpoint_version {common.get('checkpoint_version')}")
    if not release and "iteration" not in common:
        raise ValueError(f"{folder}: no iteration in the common state")
    return folder


def cli_checks(checks: dict[str, str], cases: list[dict[str, Any]]) -> None:
    """Megatron loads each CLI output under its strategies, from the directory
    Megatron-LM's ``--load`` reads; the HF weights are the truth."""
    from areal_fn.runtime.hf.io import HfCheckpoint

    for case in cases:
        spec = model_from_hf_config(case["hf"])
        with HfCheckpoint(case["hf"]) as hf:
            truth = {n: hf.read_full(n) for n in hf.names}
        try:
            folder = megatron_lm_load_dir(Path(case["ckpt"]))
        except Exception:
            problem = traceback.format_exc()[-2000:]
            for strategy in case["loads"]:
                checks[f"cli {case['name']}: megatron loads it under {strategy}"] = problem
            continue
        for strategy in case["loads"]:
            checks[f"cli {case['name']}: megatron loads it under {strategy}"] = megatron_loads(
                spec, truth, strategy, case["vocab"], folder
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cli", help="JSON list of {name, hf, ckpt, vocab, loads}")
    args = p.parse_args()
    out = Path(args.out)
    checks: dict[str, str] = {}
    stub_psutil_probe()
    rank = -1
    try:
        with megatron_session(MegatronSizes(), seed=0):
            rank = dist.get_rank()
        round_trip(checks, "dense", SPEC, "t2", ("p2",), out, layer_spec="te", vocab=VOCAB_PADDED)
        for name, config, saves, loads in MOE_CASES:
            spec = model_from_hf_config(config)
            vocab = padded_vocab_size(spec.vocab_size, tp=2)
            round_trip(checks, name, spec, saves, loads, out, layer_spec="local", vocab=vocab)
        optimizer_checks(checks, out)
        if args.cli:
            cli_checks(checks, json.loads(Path(args.cli).read_text()))
    finally:
        (out / f"rank{max(rank, 0)}.json").write_text(json.dumps({"checks": checks}, indent=1))


if __name__ == "__main__":
    main()
