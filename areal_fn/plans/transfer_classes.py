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
:class:`~areal_fn.plans.transfer_records.Transfer`).
"""

import contextlib
import gc
import itertools
import math
from collections.abc import Iterable, Iterator

from areal_fn.errors import PlanError
from areal_fn.layouts.layout import Layout, LogicalTensor, _local_template
from areal_fn.model.tensor_spec import DTYPE_BYTES
from areal_fn.plans.transfer_records import Transfer, trusted_transfer
from areal_fn.sharding.box import Box

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


def _contains(outer: Ranges, inner: Ranges) -> bool:
    return all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(outer, inner, strict=True))


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
    """One layout's logical tensors, indexed by canonical tensor; classed on demand."""

    def __init__(self, layout: Layout, ranks: tuple[int, ...], *, exact: bool) -> None:
        self.layout, self.ranks = layout, ranks
        self.exact = exact  # presence coordinates are part of the class (colocated ranks)
        #: canonical -> {tensor index: its fusion indices holding it}, in tensor order
        self.members: dict[str, dict[int, tuple[int, ...]]] = {}
        get = self.members.get
        for ti, t in enumerate(layout.tensors):
            for fi, f in enumerate(t.fusion):
                m = get(f.canonical)
                if m is None:
                    self.members[f.canonical] = {ti: (fi,)}
                else:
                    m[ti] = (*m.get(ti, ()), fi)
        self._gid = [-1] * len(layout.tensors)
        self._pid = [-1] * len(layout.tensors)
        self.present: list[tuple[int, ...]] = []  # by presence id: layout ranks, ascending
        self.where: list[dict[int, int]] = []  # by presence id: {layout rank: position}
        self.granks: list[tuple[int, ...]] = []  # by presence id: the global ranks
        self.copies: list[int] = []  # by presence id: ranks holding each element
        self._reps: list[LogicalTensor] = []
        self._classes: dict[tuple, int] = {}
        self._presences: dict[tuple, int] = {}
        self._by_id: dict[int, int] = {}  # equal shardings are often distinct objects
        self._by_value: dict[object, int] = {}
        self._pieces: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, Box, Box], ...]] = {}

    def _sharding(self, t: LogicalTensor) -> int:
        sh = self._by_id.get(id(t.sharding))
        if sh is None:
            # the mesh by identity (cheap; equal meshes that are distinct objects only
            # make finer classes), the placements by value
            key = (id(t.sharding.mesh), t.sharding.placements)
            sh = self._by_value.setdefault(key, len(self._by_value))
            self._by_id[id(t.sharding)] = sh
        return sh

    def gid(self, ti: int) -> int:
        """The geometry class of tensor ``ti`` (shape, sharding, fusion, dtype, presence axes)."""
        g = self._gid[ti]
        if g < 0:
            t = self.layout.tensors[ti]
            fusion = tuple([(f.canonical_box.ranges, f.logical_box.ranges) for f in t.fusion])
            axes = tuple([a for a, _ in t.present]) if t.present else ()
            key = (t.shape, self._sharding(t), fusion, t.dtype, axes)
            g = self._gid[ti] = self._classes.setdefault(key, len(self._classes))
            if g == len(self._reps):
                self._reps.append(t)
        return g

    def pid(self, ti: int) -> int:
        """The presence id of tensor ``ti`` (which ranks hold it)."""
        p = self._pid[ti]
        if p < 0:
            t = self.layout.tensors[ti]
            key = (self._sharding(t), t.present)
            p = self._presences.get(key, -1)
            if p < 0:
                p = self._presences[key] = len(self.present)
                ranks = _present_ranks(t)
                self.present.append(ranks)
                self.where.append({r: i for i, r in enumerate(ranks)})
                self.granks.append(tuple(self.ranks[r] for r in ranks))
                fixed = math.prod(t.sharding.mesh.axis_size(a) for a, _ in t.present)
                self.copies.append(t.sharding.num_replicas // fixed)
            self._pid[ti] = p
        return p

    def part(self, canonical: str) -> tuple:
        """The class key of ``canonical`` on this side."""
        ms = self.members.get(canonical, {})
        if len(ms) == 1 and not self.exact:
            for t, fs in ms.items():
                return (self.gid(t), fs)
        key = tuple([(self.gid(t), fs) for t, fs in ms.items()])
        return key + tuple([self.pid(t) for t in ms])

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
            fusion = tuple((f.canonical_box, f.logical_box) for f in rep.fusion)
            out = []
            for k, r in enumerate(self.present[self.pid(t)]):
                _, template = _local_template(rep.shape, rep.sharding, r, fusion)
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
        cands = []
        for n, (_, _, hbox, _) in enumerate(self.holders):
            inter = _intersect(hbox.ranges, want)
            if inter is not None:
                cands.append((n, inter))
        whole = [n for n, inter in cands if inter == want]
        local_whole = [n for n in whole if h_ranks[n] == g]
        if whole and (local_whole or all(h_ranks[n] != g for n, _ in cands)):
            key = (0, tuple(whole))
            m = counters.get(key, 0)
            counters[key] = m + 1
            forced = local_whole[0] if local_whole else -1
            options = (forced,) if local_whole else tuple(whole)
            boxes = tuple(local_of(self.holders[n][2], self.holders[n][3], want) for n in options)
            return (0, m, forced, options, boxes)
        key = (1, tuple(n for n, _ in cands))
        m = counters.get(key, 0)
        counters[key] = m + 1
        cells = []
        for cell in _cells([inter for _, inter in cands], want):
            opts = tuple(n for n, inter in cands if _contains(inter, cell))
            if not opts:
                name = dst.layout.tensors[t].name
                raise PlanError(
                    f"destination rank {g} needs {canonical}{Box._trusted(cell)} for {name!r}, which "
                    "no source rank holds; the source layout must cover every canonical tensor the "
                    "destination needs"
                )
            local = [n for n in opts if h_ranks[n] == g]
            cells.append((cell, local[0] if local else -1, opts))
        options = tuple(sorted({n for _, f, o in cells for n in ((f,) if f >= 0 else o)}))
        return (1, m, tuple(cells), options, ())


def _cells(boxes: list[Ranges], outer: Ranges) -> Iterable[Ranges]:
    cuts = []
    for d, (lo, hi) in enumerate(outer):
        pts = {lo, hi}
        for b in boxes:
            blo, bhi = b[d]
            if lo < blo < hi:
                pts.add(blo)
            if lo < bhi < hi:
                pts.add(bhi)
        cuts.append(sorted(pts))
    for idx in itertools.product(*(range(len(c) - 1) for c in cuts)):
        yield tuple((c[i], c[i + 1]) for c, i in zip(cuts, idx, strict=True))


def _merge_runs(cells: list[tuple[Ranges, int]]) -> list[tuple[Ranges, int]]:
    """Merge grid cells assigned to the same holder into larger boxes (dim by dim)."""
    if not cells:
        return cells
    ndim = len(cells[0][0])
    for d in reversed(range(ndim)):
        groups: dict[tuple, list[tuple[Ranges, int]]] = {}
        for box, h in cells:
            groups.setdefault((h, box[:d] + box[d + 1 :]), []).append((box, h))
        merged: list[tuple[Ranges, int]] = []
        for items in groups.values():
            items.sort(key=lambda x: x[0][d])
            cur = items[0]
            for nxt in items[1:]:
                if cur[0][d][1] == nxt[0][d][0]:
                    r = list(cur[0])
                    r[d] = (cur[0][d][0], nxt[0][d][1])
                    cur = (tuple(r), cur[1])
                else:
                    merged.append(cur)
                    cur = nxt
            merged.append(cur)
        cells = merged
    cells.sort(key=lambda x: x[0])
    return cells


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
        self.base: dict[str, int] = {}
        self.itemsize: dict[str, int] = {}
        clock = 0
        for c in self.order:  # the clock follows from the destination layout alone
            size = self._itemsize(c)
            clock = -(-clock // size) * size  # each tensor starts on a multiple of its element
            self.base[c] = clock
            clock += self.dst.held(c) * size

    def _itemsize(self, c: str) -> int:
        tensors, members = self.src.layout.tensors, self.src.members.get(c, {})
        if len(members) == 1:
            for t in members:
                self.itemsize[c] = size = DTYPE_BYTES[tensors[t].dtype]
                return size
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
        self.itemsize[c] = size = sizes.pop()
        return size

    def template(self, c: str) -> _Template:
        key = (self.dst.part(c), self.src.part(c))
        tpl = self._templates.get(key)
        if tpl is None:
            tpl = self._templates[key] = _Template(self.src, self.dst, c, self.itemsize[c])
        return tpl

    def world(self) -> list[Transfer]:
        """Every row of the plan, in plan order."""
        out: list[Transfer] = []
        with _no_gc():
            for c in self.order:
                tpl = self.template(c)
                self._emit(c, tpl, range(len(tpl.rows)), out, None)
        return out

    def rank(self, rank: int) -> list[Transfer]:
        """The rows of the plan in which global ``rank`` sends or receives, in plan order."""
        j = dict(zip(self.dst.ranks, range(len(self.dst.ranks)), strict=True)).get(rank)
        i = dict(zip(self.src.ranks, range(len(self.src.ranks)), strict=True)).get(rank)
        sides = [(s, x, by) for s, x, by in ((self.dst, j, 0), (self.src, i, 1)) if x is not None]
        out: list[Transfer] = []
        for c in self.order:
            found: list[tuple[int, int, int]] = []
            for side, idx, by in sides:
                for e, t in enumerate(side.members.get(c, {})):
                    k = side.where[side.pid(t)].get(idx)
                    if k is not None:
                        found.append((by, e, k))
            if not found:
                continue
            tpl = self.template(c)
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
        holders, rows, add = tpl.holders, tpl.rows, out.append
        for w in wants:
            e, k, cbox, lbox, nbytes, off, kind, m, a, options, boxes = rows[w]
            g = dst.granks[dst.pid(d_t[e])][k]
            d_name = d_tensors[d_t[e]].name
            if kind == 0:
                x = 0 if a >= 0 else (m + pos) % len(options)
                he, hk = holders[options[x]][:2]
                s = src.granks[src.pid(s_t[he])][hk]
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
            chosen = [
                (cell, f if f >= 0 else opts[(m + q + pos) % len(opts)])
                for q, (cell, f, opts) in enumerate(a)
            ]
            for box, n in _merge_runs(chosen):
                he, hk, hc, hl = holders[n]
                s, part = src.granks[src.pid(s_t[he])][hk], _numel(box) * size
                if keep is None or keep == s or keep == g:
                    add(
                        trusted_transfer(
                            s,
                            g,
                            c,
                            Box._trusted(box),
                            s_tensors[s_t[he]].name,
                            local_of(hc, hl, box),
                            d_name,
                            local_of(cbox, lbox, box),
                            part,
                            off,
                        )
                    )
                off += part


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while millions of acyclic rows are made (it
    would rescan them over and over); restore its state after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
