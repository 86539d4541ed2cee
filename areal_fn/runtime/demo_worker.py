"""Demo worker (run under torchrun by :mod:`areal_fn.runtime.demo`, 4 processes).

Stages (each recorded in the final verification table printed by rank 0):

1. plan: the layouts of ``fsdp:d2t2``, ``megatron:t2p2`` and an inference ``sglang:d1t2``
   (pure; bad input would fail here, before any process group exists);
2. train: a tiny Qwen2-architecture model (random weights from :data:`DEMO_CONFIG`)
   under FSDP2 + TP ``d2t2`` for N steps on a synthetic next-token task;
3. checkpoint: canonical tensors written as an HF safetensors checkpoint (rank 0,
   atomic);
4. resume under ``megatron:t2p2``: a Megatron-Core GPTModel loaded from the checkpoint
   through the conversion layer; its canonical weights must equal the trainer's
   bitwise, and its logits must equal the HF reference model's;
5. weight sync to an inference group (TP2, ranks 2-3) by a planned shard-to-shard
   transfer; the inference shards must equal the trainer's weights and hold exactly
   their shard's bytes.
"""

import argparse
import os
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from areal_fn.allocation_parse import parse_allocation
from areal_fn.cli import DEMO_CONFIG, layout_for
from areal_fn.convert import to_hf, to_megatron
from areal_fn.model import model_from_hf_config
from areal_fn.tensor_spec import DTYPE_BYTES
from areal_fn.transfer import bucket, plan_transfers

RESULTS: list[tuple[str, bool, str]] = []


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def log(msg: str) -> None:
    if _rank() == 0:
        print(msg, flush=True)


def record(what: str, ok: bool, figure: str) -> None:
    RESULTS.append((what, bool(ok), figure))
    log(f"[{'ok' if ok else 'FAIL'}] {what}: {figure}")


def batches(vocab: int, steps: int, batch: int = 8, seq: int = 16) -> list[torch.Tensor]:
    """Sequences of an affine recurrence t' = (5 t + 3) mod V from random starts: learnable."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        seqs = [start]
        for _ in range(seq - 1):
            seqs.append((seqs[-1] * 5 + 3) % vocab)
        out.append(torch.cat(seqs, dim=1))
    return out


def hf_model(spec_cfg: dict[str, Any]) -> torch.nn.Module:
    import transformers

    cfg = dict(spec_cfg)
    mt = cfg.pop("model_type")
    cfg.pop("architectures", None)
    cfg.pop("torch_dtype", None)
    config = transformers.AutoConfig.for_model(mt, **cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)


def stage_plan(spec: Any) -> dict[str, Any]:
    layouts = {}
    for alloc in ("fsdp:d2t2", "megatron:t2p2", "sglang:d1t2"):
        a = parse_allocation(alloc)
        comp = a.components[0]
        layout = layout_for(spec, comp)
        layouts[alloc] = layout
        if _rank() == 0:
            per_rank = [
                sum(t.numel for t in layout.local_tensors(r)) for r in range(layout.world_size)
            ]
            log(
                f"plan {alloc}: meshes {', '.join(str(m) for m in layout.meshes)}; elements per rank {per_rank}"
            )
    record("plan", True, f"{len(layouts)} layouts of {spec.num_params:,} parameters")
    return layouts


def stage_train(spec: Any, layout: Any, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    from areal_fn.runtime.fsdp2 import apply_fsdp2, export_canonical, init_mesh

    model = hf_model(DEMO_CONFIG)
    mesh = init_mesh(layout.meshes[0])
    model = apply_fsdp2(model, layout, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for ids in batches(spec.vocab_size, steps):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        loss = (
            out.loss.detach().full_tensor()
            if hasattr(out.loss, "full_tensor")
            else out.loss.detach()
        )
        losses.append(float(loss))
        log(f"train step {len(losses)}: loss {losses[-1]:.4f}")
    canonical = export_canonical(model, layout)
    record(
        "train fsdp:d2t2",
        losses[-1] < losses[0],
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps",
    )
    return canonical, losses


def stage_checkpoint(spec: Any, canonical: dict[str, torch.Tensor], workdir: Path) -> Path:
    from areal_fn.runtime.hf_io import write_hf_checkpoint

    path = workdir / "checkpoint-hf"
    if dist.get_rank() == 0:
        write_hf_checkpoint(path, canonical, model=spec, config=spec.hf_config(), overwrite=True)
    dist.barrier()
    size = sum(t.numel() * t.element_size() for t in canonical.values())
    record(
        "checkpoint",
        path.exists(),
        f"{len(canonical)} canonical tensors, {size / 2**20:.2f} MiB -> {path.name}",
    )
    return path


def stage_megatron(spec: Any, layout: Any, path: Path, canonical: dict[str, torch.Tensor]) -> None:
    from areal_fn.runtime import megatron_build as mb
    from areal_fn.runtime.hf_io import HfCheckpoint

    rank = dist.get_rank()
    dims = layout.tensors[0].sharding.mesh.shape
    sizes = mb.MegatronSizes(tp=dims["tp"], pp=dims["pp"])
    arch = attrs.asdict(spec)
    with mb.megatron_session(sizes, seed=0):
        config = mb.transformer_config(arch, sizes)
        vocab = layout.tensor("embedding.word_embeddings.weight").shape[0]
        chunks = mb.build_model_chunks(arch, config, vocab_size=vocab)
        with HfCheckpoint(path) as ckpt:
            state = to_megatron(ckpt.read, layout, rank)
        params = dict(chunks[0].named_parameters())
        missing = sorted(set(state) ^ set(params))
        with torch.no_grad():
            for name, t in state.items():
                params[name].copy_(t)
        # canonical weights back from every rank's live parameters
        mine = {n: p.detach().clone() for n, p in params.items()}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        back = to_hf(dict(enumerate(gathered)), layout)
        same = not missing and all(
            torch.equal(back[k].view(torch.uint8), canonical[k].view(torch.uint8))
            for k in canonical
        )
        record(
            "resume megatron:t2p2",
            same,
            f"{len(back)} canonical tensors bitwise equal to the trainer's"
            if same
            else f"mismatch; name diff {missing[:4]}",
        )
        ids = batches(spec.vocab_size, 1)[0][:4]
        logits = mb.pipeline_forward_logits(chunks, ids)
        result = None
        if logits is not None:
            full = mb.gather_tp_logits(logits)[..., : spec.vocab_size]
            ref = hf_model(DEMO_CONFIG)
            ref.load_state_dict(_hf_state(spec, canonical))
            with torch.no_grad():
                want = ref(input_ids=ids).logits
            result = float((full - want).abs().max())
        results: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        diff = max(r for r in results if r is not None)
        record(
            "megatron logits vs HF", diff < 1e-4, f"max |diff| {diff:.2e} (fp32, pipeline forward)"
        )


def _hf_state(spec: Any, canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from areal_fn.families.hf_memory import canonical_to_hf_state

    return canonical_to_hf_state(canonical, spec)


def stage_sync(spec: Any, trainer: Any, canonical: dict[str, torch.Tensor]) -> None:
    """Planned shard-to-shard sync trainer (ranks 0-3) -> inference TP2 (ranks 2-3)."""
    from areal_fn.convert import to_megatron as local_state
    from areal_fn.inference_layout import inference_layout

    rank = dist.get_rank()
    comp = parse_allocation("sglang:d1t2").components[0]
    infer = inference_layout(spec, comp.dims)
    plan = plan_transfers(trainer, infer, src_ranks=range(4), dst_ranks=(2, 3))
    buckets = bucket(plan, 1 << 20, version=1)
    src = local_state(canonical, trainer, rank)  # the trainer's live shards, as exported
    dst = (
        {lt.name: torch.zeros(lt.shape) for lt in infer.local_tensors(rank - 2)}
        if rank >= 2
        else {}
    )
    received = 0
    for b in buckets.buckets:
        ops = []
        recv_bufs = []
        for t in b.transfers:
            if t.src == rank and t.dst == rank:
                region = dst[t.dst_tensor][t.dst_box.slices()]
                region.copy_(src[t.src_tensor][t.src_box.slices()].reshape(region.shape))
            elif t.src == rank:
                ops.append(
                    dist.P2POp(
                        dist.isend, src[t.src_tensor][t.src_box.slices()].contiguous(), t.dst
                    )
                )
            elif t.dst == rank:
                buf = torch.empty(t.box.shape, dtype=torch.float32)
                recv_bufs.append((t, buf))
                ops.append(dist.P2POp(dist.irecv, buf, t.src))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for t, buf in recv_bufs:
            region = dst[t.dst_tensor][t.dst_box.slices()]
            region.copy_(buf.reshape(region.shape))
            received += buf.numel() * buf.element_size()
    ok = True
    if rank >= 2:
        want = local_state(canonical, infer, rank - 2)
        ok = all(torch.equal(dst[k], want[k]) for k in want)
    need = plan.recv_bytes().get(rank, 0)
    oks: list[Any] = [None] * 4
    dist.all_gather_object(oks, (ok, received, need))
    good = all(o[0] for o in oks) and all(o[1] == o[2] for o in oks)
    inf_bytes = [o[1] for o in oks[2:]]
    shard = [
        sum(lt.numel for lt in infer.local_tensors(j)) * DTYPE_BYTES[spec.dtype] for j in range(2)
    ]
    record(
        "weight sync -> sglang:d1t2",
        good,
        f"{len(buckets.buckets)} buckets, {plan.bytes_total} B over the wire (= lower bound {plan.lower_bound}); "
        f"inference ranks received {inf_bytes} B of shards {shard} B (rest local)",
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    spec = model_from_hf_config(DEMO_CONFIG)
    workdir = Path(args.workdir)
    backend = os.environ.get("AREAL_FN_BACKEND", "gloo")
    start = time.perf_counter()
    layouts = stage_plan(spec)  # pure: before any process group
    dist.init_process_group(backend=backend)
    try:
        canonical, _ = stage_train(spec, layouts["fsdp:d2t2"], args.steps)
        path = stage_checkpoint(spec, canonical, workdir)
        stage_megatron(spec, layouts["megatron:t2p2"], path, canonical)
        stage_sync(spec, layouts["fsdp:d2t2"], canonical)
    finally:
        if dist.get_rank() == 0:
            _summary(time.perf_counter() - start)
        dist.destroy_process_group()
    if not all(ok for _, ok, _ in RESULTS):
        raise SystemExit(1)


def _summary(seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"areal_fn demo: verified on CPU/gloo, 4 ranks, {seconds:.1f} s")
    table.add_column("check")
    table.add_column("result")
    table.add_column("figures")
    for what, ok, figure in RESULTS:
        table.add_row(what, "[green]ok[/]" if ok else "[red]FAIL[/]", figure)
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
