"""Transfer planning by geometry class: the whole plan, or one rank's rows of it.

Canonical tensors that share their geometry in both layouts (a layer's experts, a
model's layers: equal shapes, shardings, fusion structure and dtypes, present on
ranks that differ only in a pipeline or expert coordinate) get equal transfers up to
names and ranks. The planner keys every canonical tensor by that geometry, plans each
class once (a :class:`_Template`: which source piece serves which destination piece,
by position) and instantiates the class by name, mapping positions to ranks.

**Source choice** is local to each destination piece, so that one rank can plan its
own rows without planning the world:

- a destination rank that holds the whole piece as a source copies it locally;
- otherwise, if some source pieces hold it whole, the ``m``-th destination piece of
  this canonical tensor with that set of ``k`` holders (in plan order) takes holder
  ``(m + p) % k``, ``p`` being the tensor's position in the destination model: the
  replicas take turns within a tensor and across tensors;
- a piece no single holder covers (or one a destination rank holds only in part) is
  cut into cells along the holders' boundaries; each cell is copied locally where it
  can be, else from holder ``(m + q + p) % k_q`` of its ``k_q`` holders (``q``: the
  cell's number); runs of cells from one holder merge back into boxes.

**Plan order** is canonical tensor (the destination model's order), then destination
rank, then the destination's tensors and pieces; each row's ``offset`` on the byte
clock follows from the destination layout alone (see
:class:`~areal_fn.plans.transfer.records.Transfer`).
"""

import contextlib
import gc
import itertools
import math
from collections.abc import Iterable, Iterator

from areal_fn.errors import PlanError
from areal_fn.layouts.layout import Layout, LogicalTensor, _local_template
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.plans.transfer.records import Transfer, trusted_transfer
from areal_fn.sharding.box import Box
from areal_fn.sharding.grid import grid_cells, grid_cuts, holders_by_cell, merge_runs
from areal_fn.sharding.placement import Shard, StridedShard

Ranges = tuple[tuple[int, int], ...]
#: (entry, position among the entry's present ranks, canonical box, local box)
_Piece = tuple[int, int, Box, Box]


def _intersect(a: Ranges, b: Ranges) -> Ranges | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _numel(r: Ranges) -> int:
    n = 1
    for lo, hi in r:
        n *= hi - lo
    return n


def local_of(cbox: Box, lbox: Box, box: Ranges) -> Box:
    """The local box of a piece (``cbox`` at ``lbox``) holding canonical sub-box ``box``."""
    k = lbox.ndim - cbox.ndim
    lead = lbox.ranges[:k]
    shifted = tuple(
        (lo - c + lb, hi - c + lb)
        for (lo, hi), (c, _), (lb, _) in zip(box, cbox.ranges, lbox.ranges[k:], strict=True)
    )
    return Box._trusted(lead + shifted)


def _present_ranks(t: LogicalTensor) -> tuple[int, ...]:
    """The ranks ``t`` is present on, ascending (the free axes vary, row-major)."""
    mesh = t.sharding.mesh
    fixed = dict(t.present)
    axes = [
        range(fixed[n], fixed[n] + 1) if n in fixed else range(s)
        for n, s in zip(mesh.names, mesh.sizes, strict=True)
    ]
    out = []
    for coords in itertools.product(*axes):
        r = 0
        for c, s in zip(coords, mesh.sizes, strict=True):
            r = r * s + c
        out.append(r)
    return tuple(out)


class _Side:
    """One layout's logical tensors, indexed once: by canonical tensor, geometry class
    and presence (which ranks hold each tensor)."""

    def __init__(self, layout: Layout, ranks: tuple[int, ...], *, exact: bool) -> None:
        self.layout, self.ranks = layout, ranks
        self.exact = exact  # presence coordinates are part of the class (colocated ranks)
        #: canonical -> {tensor index: its fusion indices holding it}, in tensor order
        self.members: dict[str, dict[int, tuple[int, ...]]] = {}
        self.present: list[tuple[int, ...]] = []  # by presence id: layout ranks, ascending
        self.where: list[dict[int, int]] = []  # by presence id: {layout rank: position}
        self.granks: list[tuple[int, ...]] = []  # by presence id: the global ranks
        self.copies: list[int] = []  # by presence id: ranks holding each element
        self._reps: list[LogicalTensor] = []  # by class: its first tensor
        self._pieces: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, Box, Box], ...]] = {}
        #: by tensor index: its geometry class and its presence id
        self.gids, self.pids = self._index(layout.tensors)

    def _index(self, tensors: tuple[LogicalTensor, ...]) -> tuple[list[int], list[int]]:
        """Fill ``members`` and the presences; the class and presence of every tensor.

        A class is (shape, sharding, fusion boxes, dtype, presence axes); a sharding is
        its mesh by identity (equal meshes that are distinct objects only make finer
        classes) and its placements by value (equal shardings are often distinct objects).
        """
        members, get = self.members, self.members.get
        classes: dict[tuple, int] = {}
        presences: dict[tuple, int] = {}
        by_id: dict[int, int] = {}
        by_value: dict[object, int] = {}
        gids, pids = [], []
        for ti, t in enumerate(tensors):
            fusion = []
            for fi, f in enumerate(t.fusion):
                fusion.append((f.canonical_box.ranges, f.logical_box.ranges))
                m = get(f.canonical)
                if m is None:
                    members[f.canonical] = {ti: (fi,)}
                else:
                    m[ti] = (*m.get(ti, ()), fi)
            sharding, present = t.sharding, t.present
            sh = by_id.get(id(sharding))
            if sh is None:
                key = (id(sharding.mesh), sharding.placements)
                sh = by_id[id(sharding)] = by_value.setdefault(key, len(by_value))
            axes = tuple([a for a, _ in present]) if present else ()
            g = classes.setdefault((t.shape, sh, tuple(fusion), t.dtype, axes), len(classes))
            if g == len(self._reps):
                self._reps.append(t)
            gids.append(g)
            p = presences.setdefault((sh, present), len(presences))
            if p == len(self.present):
                self._add_presence(t)
            pids.append(p)
        return gids, pids

    def _add_presence(self, t: LogicalTensor) -> None:
        ranks = _present_ranks(t)
        self.present.append(ranks)
        self.where.append({r: i for i, r in enumerate(ranks)})
        self.granks.append(tuple(self.ranks[r] for r in ranks))
        fixed = math.prod(t.sharding.mesh.axis_size(a) for a, _ in t.present)
        self.copies.append(t.sharding.num_replicas // fixed)

    def gid(self, ti: int) -> int:
        """The geometry class of tensor ``ti`` (shape, sharding, fusion, dtype, presence axes)."""
        return self.gids[ti]

    def pid(self, ti: int) -> int:
        """The presence id of tensor ``ti`` (which ranks hold it)."""
        return self.pids[ti]

    def part(self, canonical: str) -> tuple:
        """The class key of ``canonical`` on this side."""
        ms = self.members.get(canonical, {})
        if len(ms) == 1 and not self.exact:
            for t, fs in ms.items():
                return (self.gids[t], fs)
        key = tuple([(self.gids[t], fs) for t, fs in ms.items()])
        return key + tuple([self.pids[t] for t in ms])

    def held(self, canonical: str) -> int:
        """Elements of ``canonical`` this side's pieces hold, over all ranks (shards tile)."""
        total = 0
        for ti, fs in self.members.get(canonical, {}).items():
            fusion = self.layout.tensors[ti].fusion
            total += sum(fusion[f].canonical_box.numel for f in fs) * self.copies[self.pid(ti)]
        return total

    def pieces(self, t: int, fs: tuple[int, ...]) -> tuple[tuple[int, Box, Box], ...]:
        """(position among present ranks, canonical box, local box) of tensor ``t``'s
        fusion pieces ``fs``, over every rank it is present on; computed per class."""
        key = (self.gid(t), fs)
        got = self._pieces.get(key)
        if got is None:
            rep = self._reps[self.gid(t)]
            # plain boxes only: a strided view's canonical_box raises (LayoutError)
            fusion = tuple((f.canonical_box, f.logical_box, None, f.tied) for f in rep.fusion)
            mesh, placements = rep.sharding.mesh, rep.sharding.placements
            # a rank's pieces depend on its coordinates along the sharded axes alone
            split = [a for a, p in enumerate(placements) if isinstance(p, Shard | StridedShard)]
            seen: dict[tuple[int, ...], tuple] = {}
            out = []
            for k, r in enumerate(self.present[self.pid(t)]):
                coords = mesh.coords(r)
                geometry = tuple([coords[a] for a in split])
                template = seen.get(geometry)
                if template is None:
                    _, template = _local_template(rep.shape, rep.sharding, r, fusion)
                    seen[geometry] = template
                for i, cbox, lbox in template:
                    if i in fs and cbox is not None and not cbox.is_empty:
                        out.append((k, cbox, lbox))
            got = self._pieces[key] = tuple(out)
        return got

    def merged(self, canonical: str) -> list[_Piece]:
        """Every piece of ``canonical`` on this side, by rank, then tensor, then piece."""
        out: list[tuple[int, int, int, Box, Box]] = []
        for e, (t, fs) in enumerate(self.members.get(canonical, {}).items()):
            present = self.present[self.pid(t)]
            out.extend((present[k], e, k, c, lb) for k, c, lb in self.pieces(t, fs))
        out.sort(key=lambda x: (x[0], x[1]))
        return [(e, k, c, lb) for _, e, k, c, lb in out]


class _Template:
    """One class of canonical tensors planned once: rows by position, not by name.

    ``rows[w]`` for destination piece ``w``: ``(entry, position, canonical box, local
    box, bytes, clock offset, kind, m, forced holder or cells, holders, source boxes)``.
    """

    def __init__(self, src: _Side, dst: _Side, canonical: str, itemsize: int) -> None:
        wants = dst.merged(canonical)
        self.holders = src.merged(canonical)
        s_members = list(src.members.get(canonical, {}))
        d_members = list(dst.members.get(canonical, {}))
        h_ranks = [src.ranks[src.present[src.pid(s_members[e])][k]] for e, k, _, _ in self.holders]
        self.rows: list[tuple] = []
        #: canonical box -> [overlapping holders and overlaps, whole holders, their local
        #: boxes, the cells and the holders of each (made when first needed)]
        self._overlaps: dict[Ranges, list] = {}
        self.by_dst: dict[tuple[int, int], list[int]] = {}
        self.by_src: dict[tuple[int, int], list[int]] = {}
        counters: dict[tuple, int] = {}
        clock = 0
        for w, (e, k, cbox, lbox) in enumerate(wants):
            g = dst.ranks[dst.present[dst.pid(d_members[e])][k]]
            nbytes = cbox.numel * itemsize
            choice = self._row(canonical, cbox, g, h_ranks, counters, d_members[e], dst)
            self.rows.append((e, k, cbox, lbox, nbytes, clock, *choice))
            clock += nbytes
            self.by_dst.setdefault((e, k), []).append(w)
            for n in choice[3]:
                lst = self.by_src.setdefault(self.holders[n][:2], [])
                if not lst or lst[-1] != w:
                    lst.append(w)
        self.clock = clock
        del self._overlaps
        #: a row's transfers, by its (cell, holder) assignment and its local box: (box,
        #: holder, source local box, destination local box, bytes) per merged run
        self.merged: dict[tuple, list[tuple[Box, int, Box, Box, int]]] = {}

    def _row(
        self,
        canonical: str,
        cbox: Box,
        g: int,
        h_ranks: list[int],
        counters: dict[tuple, int],
        t: int,
        dst: _Side,
    ) -> tuple:
        """(kind, m, forced holder or cells, holders that may serve, source boxes)."""
        want = cbox.ranges
        found = self._overlaps.get(want)
        if found is None:  # replicas of a destination want the same boxes
            cands = []
            for n, (_, _, hbox, _) in enumerate(self.holders):
                inter = _intersect(hbox.ranges, want)
                if inter is not None:
                    cands.append((n, inter))
            whole = tuple(n for n, inter in cands if inter == want)
            boxes = tuple(local_of(self.holders[n][2], self.holders[n][3], want) for n in whole)
            found = self._overlaps[want] = [cands, whole, boxes, None]
        cands, whole, boxes, grid = found
        local_whole = [x for x, n in enumerate(whole) if h_ranks[n] == g]
        if whole and (local_whole or all(h_ranks[n] != g for n, _ in cands)):
            key = (0, whole)
            m = counters.get(key, 0)
            counters[key] = m + 1
            if local_whole:
                x = local_whole[0]
                return (0, m, whole[x], (whole[x],), (boxes[x],))
            return (0, m, -1, whole, boxes)
        key = (1, tuple(n for n, _ in cands))
        m = counters.get(key, 0)
        counters[key] = m + 1
        if grid is None:
            grid = found[3] = []
            for cell, opts in _cells_with_holders(cands, want):
                if not opts:
                    name = dst.layout.tensors[t].name
                    raise PlanError(
                        f"destination rank {g} needs {canonical}{Box._trusted(cell)} for {name!r}, "
                        "which no source rank holds; the source layout must cover every canonical "
                        "tensor the destination needs"
                    )
                grid.append((cell, opts))
        cells = []
        for cell, opts in grid:
            local = [n for n in opts if h_ranks[n] == g]
            cells.append((cell, local[0] if local else -1, opts))
        options = tuple(sorted({n for _, f, o in cells for n in ((f,) if f >= 0 else o)}))
        return (1, m, tuple(cells), options, ())


def _cells_with_holders(
    cands: list[tuple[int, Ranges]], outer: Ranges
) -> list[tuple[Ranges, tuple[int, ...]]]:
    """``outer`` cut along the boundaries of the candidates' boxes (``(holder, box)``
    pairs, boxes inside ``outer``): every cell, in row-major order, with the holders
    whose box contains it, ascending (:mod:`areal_fn.sharding.grid`)."""
    boxes = [b for _, b in cands]
    cuts = grid_cuts(boxes, outer)
    holding = holders_by_cell(cuts, boxes)
    return [
        (cell, tuple(cands[i][0] for i in held))
        for cell, held in zip(grid_cells(cuts), holding, strict=True)
    ]


class Planner:
    """Plans of ``src -> dst`` on given global ranks: :meth:`world` or :meth:`rank`."""

    def __init__(
        self, src: Layout, dst: Layout, src_ranks: tuple[int, ...], dst_ranks: tuple[int, ...]
    ) -> None:
        exact = bool(set(src_ranks) & set(dst_ranks))
        self.src = _Side(src, src_ranks, exact=exact)
        self.dst = _Side(dst, dst_ranks, exact=exact)
        self.pos = {c.name: i for i, c in enumerate(dst.canonical)}
        self.order = [c.name for c in dst.canonical if c.name in self.dst.members]
        self._templates: dict[tuple, _Template] = {}
        #: canonical -> (its class key on the destination side, on the source side)
        self.keys: dict[str, tuple[tuple, tuple]] = {}
        self.base: dict[str, int] = {}
        self.itemsize: dict[str, int] = {}
        # held bytes and element sizes are functions of the class keys: computed per class
        held: dict[tuple, int] = {}
        sizes: dict[tuple, int] = {}
        d_part, s_part = self.dst.part, self.src.part
        clock = 0
        for c in self.order:  # the clock follows from the destination layout alone
            dk, sk = self.keys[c] = (d_part(c), s_part(c))
            size = sizes.get(sk)
            if size is None:
                size = sizes[sk] = self._itemsize(c)
            self.itemsize[c] = size
            n = held.get(dk)
            if n is None:
                n = held[dk] = self.dst.held(c)
            clock = -(-clock // size) * size  # each tensor starts on a multiple of its element
            self.base[c] = clock
            clock += n * size

    def _itemsize(self, c: str) -> int:
        tensors, members = self.src.layout.tensors, self.src.members.get(c, {})
        sizes = {DTYPE_BYTES[tensors[t].dtype] for t in members}
        if not sizes:
            t = next(iter(self.dst.members[c]))
            raise PlanError(
                f"the destination needs canonical tensor {c!r} for "
                f"{self.dst.layout.tensors[t].name!r}, which no source rank holds; the source "
                "layout must cover every canonical tensor the destination needs"
            )
        if len(sizes) > 1:
            raise PlanError(
                f"canonical tensor {c!r} is held with element sizes {sorted(sizes)} B in the "
                "source layout; every source tensor holding it must have one dtype"
            )
        return sizes.pop()

    def template(self, c: str) -> _Template:
        key = self.keys[c]
        tpl = self._templates.get(key)
        if tpl is None:
            tpl = self._templates[key] = _Template(self.src, self.dst, c, self.itemsize[c])
        return tpl

    def world(self) -> list[Transfer]:
        """Every row of the plan, in plan order."""
        out: list[Transfer] = []
        with no_gc():
            for c in self.order:
                tpl = self.template(c)
                self._emit(c, tpl, range(len(tpl.rows)), out, None)
        return out

    def rank(self, rank: int) -> list[Transfer]:
        """The rows of the plan in which global ``rank`` sends or receives, in plan order."""
        j = dict(zip(self.dst.ranks, range(len(self.dst.ranks)), strict=True)).get(rank)
        i = dict(zip(self.src.ranks, range(len(self.src.ranks)), strict=True)).get(rank)
        sides = [
            (side.members, side.pids, side.where, x, by)
            for side, x, by in ((self.dst, j, 0), (self.src, i, 1))
            if x is not None
        ]
        out: list[Transfer] = []
        templates, keys = self._templates, self.keys
        for c in self.order:
            found: list[tuple[int, int, int]] = []
            for members, pids, where, idx, by in sides:
                for e, t in enumerate(members.get(c, ())):
                    k = where[pids[t]].get(idx)
                    if k is not None:
                        found.append((by, e, k))
            if not found:
                continue
            tpl = templates.get(keys[c]) or self.template(c)
            mine = [
                w for by, e, k in found for w in (tpl.by_src if by else tpl.by_dst).get((e, k), ())
            ]
            self._emit(c, tpl, sorted(set(mine)) if len(found) > 1 else mine, out, rank)
        return out

    def _emit(
        self, c: str, tpl: _Template, wants: Iterable[int], out: list[Transfer], keep: int | None
    ) -> None:
        pos, base, size = self.pos[c], self.base[c], self.itemsize[c]
        src, dst = self.src, self.dst
        d_t, s_t = list(dst.members[c]), list(src.members[c])
        d_tensors, s_tensors = dst.layout.tensors, src.layout.tensors
        holders, rows, add, merged = tpl.holders, tpl.rows, out.append, tpl.merged
        d_granks, d_pids, s_granks, s_pids = dst.granks, dst.pids, src.granks, src.pids
        for w in wants:
            e, k, cbox, lbox, nbytes, off, kind, m, a, options, boxes = rows[w]
            g = d_granks[d_pids[d_t[e]]][k]
            d_name = d_tensors[d_t[e]].name
            if kind == 0:
                x = 0 if a >= 0 else (m + pos) % len(options)
                he, hk = holders[options[x]][:2]
                s = s_granks[s_pids[s_t[he]]][hk]
                if keep is None or keep == s or keep == g:
                    add(
                        trusted_transfer(
                            s,
                            g,
                            c,
                            cbox,
                            s_tensors[s_t[he]].name,
                            boxes[x],
                            d_name,
                            lbox,
                            nbytes,
                            base + off,
                        )
                    )
                continue
            off += base
            chosen = tuple(
                (cell, f if f >= 0 else opts[(m + q + pos) % len(opts)])
                for q, (cell, f, opts) in enumerate(a)
            )
            key = (chosen, lbox.ranges)
            runs = merged.get(key)
            if runs is None:  # replicas of a destination get the same cells and holders
                runs = merged[key] = [
                    (
                        Box._trusted(box),
                        n,
                        local_of(holders[n][2], holders[n][3], box),
                        local_of(cbox, lbox, box),
                        _numel(box) * size,
                    )
                    for box, n in merge_runs(list(chosen))
                ]
            for box, n, src_box, dst_box, part in runs:
                he, hk = holders[n][:2]
                s = s_granks[s_pids[s_t[he]]][hk]
                if keep is None or keep == s or keep == g:
                    add(
                        trusted_transfer(
                            s,
                            g,
                            c,
                            box,
                            s_tensors[s_t[he]].name,
                            src_box,
                            d_name,
                            dst_box,
                            part,
                            off,
                        )
                    )
                off += part


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while millions of acyclic rows are made (it
    would rescan them over and over); restore its state after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
