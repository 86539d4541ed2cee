"""Memory estimates for the published models under a few strategies, and the advisor's picks.

For every config in ``specs/models``: the busiest rank's memory (GiB) under a few
FSDP2 and Megatron strategies under ``--precision bf16`` as each engine runs it (Megatron:
bf16 weights, fp32 gradients, fp32 master weights and Adam states; FSDP2: fp32 sharded
weights, gradients and Adam states, bf16 compute; one 4,096-token sequence per
micro-batch with full recompute), then
:func:`areal_fn.plans.advisor.suggest_strategy`'s top three on 8 and on 64 devices of
80 GiB. Megatron stages: the even split, or when ``pp`` does not divide the layers the
first stages one layer longer. The tables in ``docs/memory.md`` are this output.

    .venv/bin/python -m bench.bench_memory
"""

from pathlib import Path

from areal_fn.errors import PlanError
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.pipeline.partition import split_evenly
from areal_fn.plans.advisor import suggest_strategy
from areal_fn.plans.advisor.census import fsdp2_census, megatron_census
from areal_fn.plans.memory import GIB, ActivationModel, PrecisionPolicy, estimate_memory
from areal_fn.plans.precision import engine_policy
from areal_fn.strategy.allocation import Backend
from areal_fn.strategy.parse import parse_allocation

SPECS = Path(__file__).resolve().parent.parent / "specs" / "models"
POLICY = PrecisionPolicy.bf16_mixed()
ACTIVATION = ActivationModel(micro_batch_size=1, seq_len=4096, recompute=True)
DEVICE = 80 * GIB

#: Strategies shown per model (every one valid for its model).
STRATEGIES: dict[str, tuple[str, ...]] = {
    "Qwen2.5-0.5B": ("fsdp:d8", "megatron:d8", "megatron:d4t2"),
    "Llama-3.2-1B": ("fsdp:d8", "megatron:d8", "megatron:d2p2t2"),
    "Qwen2.5-7B": ("fsdp:d8", "megatron:d8", "megatron:d2p2t2", "fsdp:d64"),
    "Llama-3.1-8B": ("fsdp:d8", "megatron:d8", "megatron:d2p2t2", "fsdp:d64"),
    "Qwen3-8B": ("fsdp:d8", "megatron:d8", "megatron:d2p2t2", "fsdp:d64"),
    "Llama-3.1-70B": ("fsdp:d8t8", "megatron:d1p8t8", "fsdp:d64", "megatron:d4p8t2"),
    "Qwen2.5-72B": ("fsdp:d8t8", "megatron:d1p8t8", "fsdp:d64", "megatron:d4p8t2"),
    "Llama-3.1-405B": ("fsdp:d16t8", "megatron:d1p16t8", "megatron:d4p16t4"),
    "Qwen3-30B-A3B": ("fsdp:d8", "megatron:d8e8", "megatron:d4p2e4", "megatron:d64e8"),
    "Qwen3-235B-A22B": ("fsdp:d64", "megatron:d4p8t2e8", "megatron:d16p8t2e8"),
}


def _peak_row(model: ModelSpec, allocation: str) -> str:
    comp = parse_allocation(allocation).components[0]
    dims = comp.dims
    if comp.backend is Backend.FSDP:
        census = fsdp2_census(model, dims)
    elif model.num_layers % (dims.pp * dims.vpp):
        stages = split_evenly([1.0] * model.num_layers, dims.pp, vpp=dims.vpp)
        census = megatron_census(model, dims, stages=stages)
    else:
        census = megatron_census(model, dims)
    policy = engine_policy(POLICY, comp.backend)  # what its engine runs
    report = estimate_memory(census, policy, activation=ACTIVATION, model=model, dims=dims)
    r = report.max_rank
    cells = (r.params, r.grads, r.optimizer, r.activations, r.buffers, r.total)
    fits = "yes" if r.total <= 0.9 * DEVICE else "no"
    return (
        f"| {allocation} | {dims.world_size} | "
        + " | ".join(f"{c / GIB:.1f}" for c in cells)
        + f" | {r.rank} | {fits} |"
    )


def _advice(model: ModelSpec, n: int) -> list[str]:
    try:
        picks = suggest_strategy(model, n, DEVICE, policy=POLICY, activation=ACTIVATION, top=3)
    except PlanError as exc:
        head = str(exc).split("; policy")[0]
        return [f"- {n} x 80 GiB: {head}"]
    lines = [f"- {n} x 80 GiB:"]
    for i, s in enumerate(picks, 1):
        lines.append(f"  {i}. {s.why}")
    return lines


def tables() -> str:
    """The markdown of every model's memory table and advice."""
    out: list[str] = []
    for name, strategies in STRATEGIES.items():
        model = model_from_hf_config(SPECS / f"{name}.json")
        out.append(f"### {name} ({model.num_params / 1e9:.2f}B parameters)")
        out.append("")
        out.append(
            "| strategy | ranks | params | grads | optim | activ | buffers | peak GiB | "
            "peak rank | fits 90% of 80 GiB |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        out.extend(_peak_row(model, a) for a in strategies)
        out.append("")
        out.append("Advisor's top three:")
        out.append("")
        for n in (8, 64):
            out.extend(_advice(model, n))
        out.append("")
    return "\n".join(out)


def run() -> None:
    print(f"Policy: {POLICY} (FSDP2: {engine_policy(POLICY, Backend.FSDP)}).")
    print(f"Activations: {ACTIVATION}.")
    print("Memory columns are the busiest rank's GiB (params, grads, optim exact; activ and")
    print("buffers estimated).")
    print()
    print(tables())


if __name__ == "__main__":
    run()
