"""torchrun worker: real DTensor / FSDP2 / TP layouts against areal_fn's records.

Launched once by ``tests/distributed/test_dtensor_dist.py`` with 8 ranks (gloo, CPU). Every
rank draws the same deterministic random cases (seeded ``random.Random``), runs the
collectives, compares what it holds with what the pure core predicts, and writes
``<out>/rank<r>.json``: case counts per section, failures (with details) and
observations (known divergences between DTensor's metadata and the data it holds).
Checks never raise mid-section (a rank that raised would leave the others waiting in
a collective): they record, and the process exits 1 at the end if anything failed.

Sections:

``dtensor``
    ``distribute_tensor(t, mesh, placements)`` on meshes (8,), (2, 4), (4, 2),
    (2, 2, 2): ``to_local()`` equals ``shard(t, s, rank)`` in shape and bits.
``from_local``
    ``DTensor.from_local(shard(t, s, rank), ...).full_tensor()`` equals ``t``; with
    ``Partial`` placements and independent per-rank values, equals ``unshard``.
``groups``
    ``Mesh.groups(axis)`` equals ``get_process_group_ranks(mesh.get_group(axis))``.
``fsdp2``
    ``parallelize_module`` (Colwise/Rowwise on Linear and Embedding) then
    ``fully_shard`` over dp on (dp=2, tp=4) and (dp=4, tp=2); HSDP on
    (dp_replicate=2, dp_shard=4); HSDP + TP on (2, 2, 2); FSDP with ``Shard(1)``:
    every parameter's placements, local shape and local data against our records.
"""

import argparse
import json
import math
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.sharding.mesh import Mesh  # noqa: E402
from areal_fn.sharding.placement import Partial, Placement, Replicate, Shard, StridedShard  # noqa: E402
from areal_fn.sharding.shard import shard, unshard  # noqa: E402
from areal_fn.sharding.sharding import Sharding, local_shape  # noqa: E402
from tests.torch_placements import (  # noqa: E402
    from_torch_all,
    gather_safe,
    is_gather_safe,
    split_is_nested,
    to_torch_all,
)

MESHES: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = (
    (("dp",), (8,)),
    (("dp", "tp"), (2, 4)),
    (("dp", "tp"), (4, 2)),
    (("pp", "dp", "tp"), (2, 2, 2)),
)
SIDES = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16)


class Recorder:
    """Counts, failures and observations of one rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.counts: dict[str, int] = {}
        self.failures: list[dict[str, Any]] = []
        self.observations: list[dict[str, Any]] = []
        self.seconds: dict[str, float] = {}
        self.current: dict[str, Any] = {}

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def fail(self, section: str, **details: Any) -> None:
        self.failures.append({"section": section, "rank": self.rank, **details})

    def check(self, ok: bool, section: str, **details: Any) -> bool:
        if not ok:
            self.fail(section, **details)
        return ok


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous(), b.contiguous()
    if a.dtype.is_floating_point:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))


# ----------------------------------------------------------------- random cases
def draw_placement(rng: random.Random, ndim: int) -> Placement:
    kind = rng.choice(("R", "S", "S", "SS", "SS"))
    if kind == "R":
        return Replicate()
    dim = rng.randrange(ndim)
    if kind == "S":
        return Shard(dim=dim)
    return StridedShard(dim=dim, split_factor=rng.randint(1, 4))


def draw_case(rng: random.Random, mesh: Mesh) -> tuple[tuple[int, ...], Sharding]:
    ndim = rng.randint(1, 3)
    shape = tuple(rng.choice(SIDES) for _ in range(ndim))
    placements = tuple(draw_placement(rng, ndim) for _ in mesh.names)
    return shape, Sharding(mesh=mesh, placements=placements)


def scatter_ok(shape: tuple[int, ...], s: Sharding) -> bool:
    """Whether ``distribute_tensor``'s scatter path (src_data_rank=0) accepts ``s``.

    torch 2.13 scatters a ``_StridedShard`` only when every rank of each group along
    that axis gets the same extent (it does not pad strided shards). Decided from the
    pure geometry, so every rank takes the same path.
    """
    mesh = s.mesh
    for i, p in enumerate(s.placements):
        if not isinstance(p, StridedShard):
            continue
        prefix = Sharding(
            mesh=mesh,
            placements=s.placements[: i + 1] + tuple(Replicate() for _ in mesh.names[i + 1 :]),
        )
        for group in mesh.groups(mesh.names[i]):
            if len({local_shape(shape, prefix, r) for r in group}) > 1:
                return False
    return True


# ----------------------------------------------------------------- sections
def section_dtensor(rec: Recorder, dms: dict[str, DeviceMesh], cases_per_mesh: int) -> None:
    rank = rec.rank
    for names, sizes in MESHES:
        mesh = Mesh(names=names, sizes=sizes)
        dm = dms[str(mesh)]
        rng = random.Random(f"dtensor-{mesh}")
        for i in range(cases_per_mesh):
            shape, s = draw_case(rng, mesh)
            rec.current = {"section": "dtensor", "case": i, "shape": shape, "sharding": str(s)}
            t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
            scatter = scatter_ok(shape, s)
            rec.count("dtensor.scatter" if scatter else "dtensor.local_split")
            dt = distribute_tensor(
                t, dm, to_torch_all(s.placements), src_data_rank=0 if scatter else None
            )
            got, want = dt.to_local(), shard(t, s, rank)
            rec.check(
                same(got, want),
                "dtensor",
                case=i,
                shape=shape,
                sharding=str(s),
                got=list(got.shape),
                want=list(want.shape),
                got_data=got.flatten().tolist()[:32],
                want_data=want.flatten().tolist()[:32],
            )
            rec.check(
                tuple(dt.placements) == to_torch_all(s.placements),
                "dtensor",
                case=i,
                sharding=str(s),
                placements=str(dt.placements),
            )
            rec.count("dtensor.cases")
            if is_gather_safe(s) and split_is_nested(shape, s):
                full = dt.full_tensor()
                rec.check(
                    same(full, t), "dtensor.full_tensor", case=i, shape=shape, sharding=str(s)
                )
                rec.count("dtensor.full_tensor")


def section_from_local(rec: Recorder, dms: dict[str, DeviceMesh], cases_per_mesh: int) -> None:
    rank = rec.rank
    for names, sizes in MESHES:
        mesh = Mesh(names=names, sizes=sizes)
        dm = dms[str(mesh)]
        rng = random.Random(f"from_local-{mesh}")
        for i in range(cases_per_mesh):
            shape, s = draw_case(rng, mesh)
            s = gather_safe(s)
            use_partial = i % 2 == 1
            if use_partial:
                # Put Partial(op) on some axes; gloo has no AVG, the in-process oracle covers it.
                op = rng.choice(("sum", "max", "min"))
                s = gather_safe(
                    Sharding(
                        mesh=mesh,
                        placements=tuple(
                            Partial(op=op) if rng.random() < 0.4 else p for p in s.placements
                        ),
                    )
                )
            rec.current = {"section": "from_local", "case": i, "shape": shape, "sharding": str(s)}
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            t = torch.randn(shape, generator=g)
            stride = contiguous_stride(shape)
            if not split_is_nested(shape, s):
                # DTensor's gather expects FSDP2's nested layout here (see split_is_nested).
                rec.count("from_local.skipped_nested")
                continue
            # (a) our own local tensors of t gather back to t bitwise.
            dt = DTensor.from_local(
                shard(t, s, rank),
                dm,
                to_torch_all(s.placements),
                run_check=False,
                shape=torch.Size(shape),
                stride=stride,
            )
            full = dt.full_tensor()
            rec.check(same(full, t), "from_local", case=i, shape=shape, sharding=str(s))
            rec.count("from_local.cases")
            if not use_partial:
                continue
            # (b) independent per-rank partial values (equal across Replicate axes; small
            # integers so every reduction order is exact) reduce like our unshard.
            part_axes = [j for j, p in enumerate(s.placements) if isinstance(p, Partial)]
            plain = Sharding(
                mesh=mesh,
                placements=tuple(
                    Replicate() if isinstance(p, Partial) else p for p in s.placements
                ),
            )
            values: dict[tuple[int, ...], torch.Tensor] = {}
            locs = []
            for r in range(mesh.size):
                key = tuple(mesh.coords(r)[j] for j in part_axes)
                if key not in values:
                    values[key] = torch.randint(-50, 50, shape, generator=g).to(torch.float32)
                locs.append(shard(values[key], plain, r))
            want = unshard(locs, s, shape=shape)
            dt = DTensor.from_local(
                locs[rank],
                dm,
                to_torch_all(s.placements),
                run_check=False,
                shape=torch.Size(shape),
                stride=stride,
            )
            full = dt.full_tensor()
            rec.check(same(full, want), "from_local.partial", case=i, shape=shape, sharding=str(s))
            rec.count("from_local.partial")


def section_groups(rec: Recorder, dms: dict[str, DeviceMesh]) -> None:
    for names, sizes in MESHES:
        mesh = Mesh(names=names, sizes=sizes)
        dm = dms[str(mesh)]
        for i, name in enumerate(names):
            theirs = tuple(dist.get_process_group_ranks(dm.get_group(i)))
            ours = mesh.group_of(rec.rank, name)
            rec.check(theirs == ours, "groups", mesh=str(mesh), axis=name, got=theirs, want=ours)
            rec.check(
                dm.get_local_rank(i) == mesh.coords(rec.rank)[i],
                "groups",
                mesh=str(mesh),
                axis=name,
                what="coordinate",
            )
            rec.count("groups.checks")


def section_known_divergence(rec: Recorder, dms: dict[str, DeviceMesh]) -> None:
    """DTensor's gather after a ``_StridedShard`` that follows a shard of the same dim."""
    mesh = Mesh.of(dp=2, tp=4)
    s = Sharding(
        mesh=mesh,
        placements=(StridedShard(dim=0, split_factor=1), StridedShard(dim=0, split_factor=2)),
    )
    t = torch.arange(16, dtype=torch.float32)
    dt = distribute_tensor(t, dms[str(mesh)], to_torch_all(s.placements), src_data_rank=None)
    local_ok = same(dt.to_local(), shard(t, s, rec.rank))
    full = dt.full_tensor()
    rec.check(local_ok, "known_divergence", what="local split differs from ours")
    rec.observations.append(
        {
            "what": "DTensor full_tensor() after distribute_tensor() with a _StridedShard "
            "following another shard of the same dim",
            "sharding": str(s),
            "full_tensor_equals_input": same(full, t),
            "full_tensor": full.tolist(),
            "unshard_equals_input": same(unshard([shard(t, s, r) for r in range(8)], s), t),
        }
    )


# ----------------------------------------------------------------- FSDP2 + TP
class Tiny(nn.Module):
    """Embeddings and Linears whose TP/FSDP2 layouts cover every placement FSDP2 makes."""

    def __init__(self, vocab: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.emb_row = nn.Embedding(vocab, hidden)
        self.emb_col = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, inter)
        self.down = nn.Linear(inter, hidden)


# TP placement of each parameter (ours) under the plan below.
TP_PLAN = {
    "emb_row": RowwiseParallel(),
    "emb_col": ColwiseParallel(),
    "up": ColwiseParallel(),
    "down": RowwiseParallel(),
}
TP_PLACEMENT: dict[str, Placement] = {
    "emb_row.weight": Shard(dim=0),
    "emb_col.weight": Shard(dim=1),
    "up.weight": Shard(dim=0),
    "up.bias": Shard(dim=0),
    "down.weight": Shard(dim=1),
    "down.bias": Replicate(),
}


def fsdp_dim0(tp: Placement, tp_size: int) -> Placement:
    """What FSDP2 puts on its dp axis when sharding dim 0 over a TP-placed parameter."""
    if isinstance(tp, (Shard, StridedShard)) and tp.dim == 0 and tp_size > 1:
        return StridedShard(dim=0, split_factor=tp_size)
    return Shard(dim=0)


def nested_fsdp_local(
    full: torch.Tensor,
    tp: Placement,
    tp_size: int,
    tp_coord: int,
    dp: Placement,
    dp_size: int,
    dp_coord: int,
) -> torch.Tensor:
    """What FSDP2 actually stores: its dp chunking applied to the TP rank's local tensor.

    An FSDP2 shard with no elements has extent 0 on the FSDP dim even where chunking
    gives more (a ``[8, 0]`` TP-local tensor becomes ``[0, 0]``, not ``[4, 0]``).
    """
    tp_local = shard(full, Sharding(mesh=Mesh.of(tp=tp_size), placements=(tp,)), tp_coord)
    out = shard(tp_local, Sharding(mesh=Mesh.of(dp=dp_size), placements=(dp,)), dp_coord)
    if out.numel() == 0 and isinstance(dp, Shard):
        out = out.new_empty(out.shape[: dp.dim] + (0,) + out.shape[dp.dim + 1 :])
    return out


def record_params(
    rec: Recorder,
    case: str,
    module: nn.Module,
    full: dict[str, torch.Tensor],
    mesh: Mesh,
    predicted: dict[str, tuple[Placement, ...]],
    nested: dict[str, Any],
) -> None:
    """Compare every parameter with our records; gather where DTensor can."""
    rank = rec.rank
    for name, param in sorted(module.named_parameters()):
        rec.count("fsdp2.params")
        want_p = predicted[name]
        if not isinstance(param, DTensor):
            rec.fail("fsdp2", case=case, param=name, what="not a DTensor")
            continue
        got_p = from_torch_all(param.placements)
        s = Sharding(mesh=mesh, placements=want_p)
        local = param.to_local()
        ours = shard(full[name], s, rank)
        details = {
            "case": case,
            "param": name,
            "shape": list(full[name].shape),
            "placements": str(Sharding(mesh=mesh, placements=got_p)),
        }
        rec.check(got_p == want_p, "fsdp2.placements", want=str(s), **details)
        rec.check(tuple(param.shape) == tuple(full[name].shape), "fsdp2.global_shape", **details)
        # FSDP2's data is TP's local tensor chunked over dp; where DTensor's placements
        # describe other data (uneven TP x dp on one dim), that is an observation, and
        # our records must agree with the placements, not the data.
        true_local = nested[name](rank)
        rec.check(same(local, true_local), "fsdp2.nested_model", **details)
        agree = all(same(shard(full[name], s, r), nested[name](r)) for r in range(mesh.size))
        if agree:
            rec.check(
                tuple(local.shape) == local_shape(tuple(full[name].shape), s, rank),
                "fsdp2.local_shape",
                got=list(local.shape),
                **details,
            )
            rec.check(same(local, ours), "fsdp2.local_data", **details)
            rec.count("fsdp2.matched")
            full_back = param.full_tensor()
            rec.check(same(full_back, full[name]), "fsdp2.full_tensor", **details)
        else:
            only_empty = all(
                shard(full[name], s, r).numel() == 0 and nested[name](r).numel() == 0
                for r in range(mesh.size)
                if not same(shard(full[name], s, r), nested[name](r))
            )
            kind = "empty_shape" if only_empty else "strided_uneven"
            rec.count(f"fsdp2.divergent.{kind}")
            rec.observations.append(
                {
                    "what": "FSDP2 local data differs from what its DTensor placements describe",
                    "kind": kind,
                    "rank": rank,
                    **details,
                    "local_shape": list(local.shape),
                    "placements_local_shape": list(local_shape(tuple(full[name].shape), s, rank)),
                }
            )


def fsdp_tp_case(
    rec: Recorder, dm: DeviceMesh, mesh: Mesh, dims: tuple[int, int, int], hsdp: bool
) -> None:
    """TP over the ``tp`` axis, then ``fully_shard`` over the dp axis (or axes, HSDP)."""
    vocab, hidden, inter = dims
    torch.manual_seed(1234)
    module = Tiny(vocab, hidden, inter)
    full = {n: p.detach().clone() for n, p in module.named_parameters()}
    tp_size = mesh.axis_size("tp")
    parallelize_module(module, dm["tp"], TP_PLAN)  # type: ignore[arg-type]
    fully_shard(module, mesh=dm["dp_replicate", "dp_shard"] if hsdp else dm["dp"])
    predicted: dict[str, tuple[Placement, ...]] = {}
    nested: dict[str, Any] = {}
    shard_axis = "dp_shard" if hsdp else "dp"
    dp_size = mesh.axis_size(shard_axis)
    for name, tp in TP_PLACEMENT.items():
        dp = fsdp_dim0(tp, tp_size)
        predicted[name] = ((Replicate(),) if hsdp else ()) + (dp, tp)

        def nested_fn(r: int, name: str = name, tp: Placement = tp) -> torch.Tensor:
            c = dict(zip(mesh.names, mesh.coords(r), strict=True))
            return nested_fsdp_local(
                full[name], tp, tp_size, c["tp"], Shard(dim=0), dp_size, c[shard_axis]
            )

        nested[name] = nested_fn
    case = f"{'hsdp+tp' if hsdp else 'fsdp+tp'} {mesh} vocab={vocab} hidden={hidden} inter={inter}"
    record_params(rec, case, module, full, mesh, predicted, nested)
    rec.count("fsdp2.cases")


def fsdp_plain_case(
    rec: Recorder, dm: DeviceMesh, mesh: Mesh, dims: tuple[int, int, int], dim: int
) -> None:
    """FSDP (1 axis) or HSDP (2 axes) without TP, sharding ``dim`` where it divides evenly.

    FSDP2 refuses uneven shards on a dim other than 0; those parameters use dim 0.
    """
    vocab, hidden, inter = dims
    torch.manual_seed(99)
    module = Tiny(vocab, hidden, inter)
    full = {n: p.detach().clone() for n, p in module.named_parameters()}
    n_shard = mesh.sizes[-1]

    def shard_dim(shape: tuple[int, ...]) -> int:
        return dim if len(shape) > dim and shape[dim] % n_shard == 0 else 0

    fully_shard(module, mesh=dm, shard_placement_fn=lambda p: TShard(shard_dim(tuple(p.shape))))
    predicted: dict[str, tuple[Placement, ...]] = {}
    nested: dict[str, Any] = {}
    for name, t in full.items():
        fs = Shard(dim=shard_dim(tuple(t.shape)))
        predicted[name] = ((Replicate(),) if mesh.ndim == 2 else ()) + (fs,)
        s = Sharding(mesh=mesh, placements=predicted[name])

        def nested_fn(r: int, name: str = name, s: Sharding = s) -> torch.Tensor:
            return shard(full[name], s, r)

        nested[name] = nested_fn
    case = f"{'hsdp' if mesh.ndim == 2 else 'fsdp'} {mesh} shard_dim={dim} vocab={vocab} hidden={hidden} inter={inter}"
    record_params(rec, case, module, full, mesh, predicted, nested)
    rec.count("fsdp2.cases")


def section_fsdp2(rec: Recorder, world: int) -> None:
    # (vocab, hidden, inter): even, and uneven over tp and/or dp (inter=9 with tp=2,
    # dp=4 is the case where FSDP2's data and its placements part ways).
    sizes = [(16, 8, 16), (10, 8, 6), (9, 12, 10), (13, 8, 9), (7, 8, 9), (3, 8, 5)]
    for dp, tp in ((2, 4), (4, 2)):
        mesh = Mesh.of(dp=dp, tp=tp)
        dm = init_device_mesh("cpu", mesh.sizes, mesh_dim_names=mesh.names)
        for dims in sizes:
            fsdp_tp_case(rec, dm, mesh, dims, hsdp=False)
    mesh = Mesh.of(dp_replicate=2, dp_shard=2, tp=2)
    dm = init_device_mesh("cpu", mesh.sizes, mesh_dim_names=mesh.names)
    for dims in sizes:
        fsdp_tp_case(rec, dm, mesh, dims, hsdp=True)
    mesh = Mesh.of(dp_replicate=2, dp_shard=4)
    dm = init_device_mesh("cpu", mesh.sizes, mesh_dim_names=mesh.names)
    for dims in sizes:
        fsdp_plain_case(rec, dm, mesh, dims, dim=0)
    mesh = Mesh.of(dp=world)
    dm = init_device_mesh("cpu", mesh.sizes, mesh_dim_names=mesh.names)
    for dims in [(16, 8, 16), (13, 16, 5)]:
        fsdp_plain_case(rec, dm, mesh, dims, dim=1)


# ----------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases-per-mesh", type=int, default=60)
    parser.add_argument("--sections", default="groups,dtensor,from_local,known_divergence,fsdp2")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rec = Recorder(rank)
    crashed = False
    try:
        if world != 8:
            rec.fail("setup", what=f"expected 8 ranks, got {world}")
            return 1
        dms = {
            str(Mesh(names=n, sizes=s)): init_device_mesh("cpu", s, mesh_dim_names=n)
            for n, s in MESHES
        }
        sections = [
            ("groups", lambda: section_groups(rec, dms)),
            ("dtensor", lambda: section_dtensor(rec, dms, args.cases_per_mesh)),
            ("from_local", lambda: section_from_local(rec, dms, args.cases_per_mesh)),
            ("known_divergence", lambda: section_known_divergence(rec, dms)),
            ("fsdp2", lambda: section_fsdp2(rec, world)),
        ]
        wanted = args.sections.split(",")
        for name, run in sections:
            if name not in wanted:
                continue
            start = time.monotonic()
            run()
            rec.seconds[name] = round(time.monotonic() - start, 2)
    except Exception:
        rec.fail("crash", during=rec.current, traceback=traceback.format_exc())
        crashed = True
    finally:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        summary = {
            "rank": rank,
            "world": world,
            "counts": rec.counts,
            "seconds": rec.seconds,
            "failures": rec.failures,
            "observations": rec.observations,
        }
        (out / f"rank{rank}.json").write_text(json.dumps(summary, indent=1, default=str))
    if not crashed:
        # Nobody exits (and so gets the others killed by torchrun) before all have written.
        dist.barrier()
    dist.destroy_process_group()
    return 1 if rec.failures else 0


if __name__ == "__main__":
    sys.exit(main())
