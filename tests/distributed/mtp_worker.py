"""torchrun worker: a DeepSeek-V3 multi-token-prediction layer through HF -> Megatron-Core
conversion, checked by the MTP layer's logits.

transformers builds no module for MTP layers, so the reference is written from their
definition, with transformers' own modules wherever one exists. Rank 0 builds:

- the main model (``transformers``, fp32, eager attention, random weights) and its
  final hidden states ``h`` (after the final norm) and logits;
- the MTP layer's decoder layer as a one-layer DeepSeek-V3 model whose only layer has
  routed experts; its final norm plays ``shared_head.norm`` and the main ``lm_head``
  its head;
- ``enorm``, ``hnorm`` and ``eh_proj`` at random, and MTP logits =
  ``one_layer_model(inputs_embeds=eh_proj([enorm(E[next]); hnorm(h)]))``, where
  ``next`` are the input ids shifted left by one (the last one 0); and, as a control,
  the same with the two halves of ``eh_proj``'s input the other way round.

The canonical tensors (main and MTP, the MTP copies of the embedding and head equal to
the main ones) go to every rank, which builds a real ``GPTModel`` with Megatron-Core's
MTP block (``mtp_num_layers=1``), loads ``to_megatron(canonical, layout, rank)`` (every
parameter must be loaded) and runs it with labels, so that its MTP block runs; both
calls of its output layer are recorded (the MTP logits first, then the main ones).
Rank 0 compares them with the reference, and ``to_hf`` of the loaded parameters with
the canonical tensors (bitwise, the MTP copies included). Writes ``<out>/report.json``.
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.layouts.megatron import megatron_layout  # noqa: E402
from areal_fn.model.hf_memory import hf_state_to_canonical  # noqa: E402
from areal_fn.model.spec import ModelSpec, model_from_hf_config  # noqa: E402
from areal_fn.plans.convert import to_hf, to_megatron  # noqa: E402
from areal_fn.runtime.megatron.build import (  # noqa: E402
    build_model_chunks,
    gather_tp_logits,
    init_distributed,
    megatron_session,
    transformer_config,
)
from areal_fn.runtime.megatron.forward import _causal_mask  # noqa: E402
from areal_fn.strategy.allocation import ParallelDims  # noqa: E402
from tests.distributed.conversion_worker import (  # noqa: E402
    BATCH,
    FAMILIES,
    SEQ,
    _hf_model,
    _load,
    _local_state,
    _max_abs,
    _on_rank0,
    arch_of,
    sizes_of,
)

CONFIG = {**FAMILIES["deepseek_v3"], "num_nextn_predict_layers": 1}
#: one layer with routed experts: the MTP layer's decoder layer
ONE_LAYER = {**FAMILIES["deepseek_v3"], "num_hidden_layers": 1, "first_k_dense_replace": 0}

STRATEGIES: dict[str, dict[str, int]] = {
    "t1": {"dp": 4},
    "t2": {"dp": 2, "tp": 2, "etp": 2},
    "e2": {"dp": 4, "ep": 2},
}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference(spec: ModelSpec, input_ids: torch.Tensor) -> dict[str, Any]:
    """Canonical tensors of the main model and its MTP layer, and both logits."""
    main = _hf_model(model_from_hf_config(FAMILIES["deepseek_v3"]), seed=7)
    layer_model = _hf_model(model_from_hf_config(ONE_LAYER), seed=8)
    canonical = hf_state_to_canonical(
        {k: v.detach().clone() for k, v in main.state_dict().items()},
        model_from_hf_config(FAMILIES["deepseek_v3"]),
    )
    one = hf_state_to_canonical(
        {k: v.detach().clone() for k, v in layer_model.state_dict().items()},
        model_from_hf_config(ONE_LAYER),
    )
    n, hid = spec.num_layers, spec.hidden_size
    p = f"model.layers.{n}."
    gen = torch.Generator().manual_seed(11)
    canonical[p + "embed_tokens.weight"] = canonical["model.embed_tokens.weight"].clone()
    canonical[p + "enorm.weight"] = 1.0 + 0.1 * torch.randn(hid, generator=gen)
    canonical[p + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(hid, generator=gen)
    canonical[p + "eh_proj.weight"] = 0.05 * torch.randn(hid, 2 * hid, generator=gen)
    for name, value in one.items():
        if name.startswith("model.layers.0."):
            canonical[p + name.removeprefix("model.layers.0.")] = value
    canonical[p + "shared_head.norm.weight"] = one["model.norm.weight"]
    canonical[p + "shared_head.head.weight"] = canonical["lm_head.weight"].clone()
    missing = sorted({t.name for t in spec.tensors} ^ set(canonical))
    assert not missing, missing
    with torch.no_grad():
        h = main.model(input_ids=input_ids).last_hidden_state
        main_logits = main.lm_head(h)
        nxt = input_ids.roll(-1, dims=-1)
        nxt[:, -1] = 0
        eps = spec.rms_norm_eps
        e = _rms(canonical["model.embed_tokens.weight"][nxt], canonical[p + "enorm.weight"], eps)
        hn = _rms(h, canonical[p + "hnorm.weight"], eps)
        proj = canonical[p + "eh_proj.weight"].T
        layer_model.lm_head.weight.copy_(canonical["lm_head.weight"])
        mtp_logits = layer_model(inputs_embeds=torch.cat((e, hn), -1) @ proj).logits
        # the control: the halves of eh_proj's input the other way round
        swapped = layer_model(inputs_embeds=torch.cat((hn, e), -1) @ proj).logits
    return {"canonical": canonical, "main": main_logits, "mtp": mtp_logits, "swapped": swapped}


def _megatron_logits(chunk: Any, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The output layer's results, in call order (MTP, then main), ``[batch, seq, vocab]``."""
    seen: list[torch.Tensor] = []
    # a copy: the loss that follows (labels given) shifts the logits in place
    hook = chunk.output_layer.register_forward_hook(lambda _m, _i, out: seen.append(out[0].clone()))
    batch, seq = input_ids.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    chunk.eval()
    try:
        with torch.no_grad():
            chunk(input_ids, positions, _causal_mask(seq), labels=input_ids)
    finally:
        hook.remove()
    return [gather_tp_logits(t).transpose(0, 1) for t in seen]


def run_case(name: str, input_ids: torch.Tensor, ref: dict[str, Any] | None) -> dict[str, Any]:
    start = time.perf_counter()
    spec = model_from_hf_config(CONFIG, mtp=True)
    payload = [None if ref is None else ref["canonical"]]
    dist.broadcast_object_list(payload, src=0)
    canonical = payload[0]
    dims = ParallelDims(**STRATEGIES[name])
    layout = megatron_layout(spec, dims)
    vpad = layout.tensor("embedding.word_embeddings.weight").shape[0]
    sizes = sizes_of(dims, moe=True)
    record: dict[str, Any] = {"case": name, "strategy": str(dims)}
    with megatron_session(sizes, seed=1234):
        config = transformer_config({**arch_of(spec), "mtp_layers": 1}, sizes)
        (chunk,) = build_model_chunks({**arch_of(spec), "mtp_layers": 1}, config, vocab_size=vpad)
        load = _load([chunk], to_megatron(canonical, layout, dist.get_rank()))
        got = _megatron_logits(chunk, input_ids)
        states = _on_rank0(_local_state([chunk]))
    if ref is not None:
        assert states is not None
        back = to_hf(dict(enumerate(states)), layout, check_replicas=True)
        v = spec.vocab_size
        record.update(
            load,
            mtp_parameters=sum(1 for n in states[0] if n.startswith("mtp.")),
            output_layer_calls=len(got),
            mtp_max_abs_diff=_max_abs(got[0][..., :v], ref["mtp"]),
            main_max_abs_diff=_max_abs(got[1][..., :v], ref["main"]),
            mtp_logits_max_abs=float(ref["mtp"].abs().max()),
            mtp_vs_main_max_abs=_max_abs(ref["mtp"], ref["main"]),
            mtp_vs_swapped_max_abs=_max_abs(got[0][..., :v], ref["swapped"]),
            roundtrip_unequal=[n for n in canonical if not torch.equal(back[n], canonical[n])],
            roundtrip_tensors=len(back),
        )
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    init_distributed()
    input_ids = torch.randint(
        0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0)
    )
    ref = (
        reference(model_from_hf_config(CONFIG, mtp=True), input_ids)
        if dist.get_rank() == 0
        else None
    )
    try:
        records = [run_case(name, input_ids, ref) for name in STRATEGIES]
        if dist.get_rank() == 0:
            (args.out / "report.json").write_text(json.dumps({"cases": records}, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
