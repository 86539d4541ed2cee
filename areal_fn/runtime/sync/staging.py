"""The staging memory of a sync group: message buffers and shadows, kept between syncs.

Reused memory is already mapped, so packing into it and receiving into it cost no page
faults (on this machine's CPUs copying into fresh memory runs at a fifth of the speed).
With ``keep_staging=True`` a sync leaves the group's staging as it is. By default it is
handed back when the sync ends (:func:`release_staging`):

- CPU buffers of at least :data:`MAPPED_MIN` bytes are mappings of their own
  (``mmap``); they are kept, and their pages given to the kernel with ``madvise
  (MADV_FREE)``: the kernel takes them when it needs memory, and until then the next
  sync writes into them without page faults. Every byte a sync reads from its staging
  it has written first (shadows are filled from the live tensor or rewritten whole,
  message buffers are packed or received whole), so pages the kernel took and gives
  back zeroed change nothing.
- Everything else is freed (device memory goes back to torch's caching allocator).

Without ``MADV_FREE`` (not Linux), CPU buffers are plain tensors and are freed too.

A sync with ``commit="swap"`` commits a shadow by exchanging storages with its live
tensor (:meth:`_Buffers.swap_in`): the live tensor keeps the shadow's memory (a mapped
one leaves the staging, so its pages are never handed back) and the live tensor's old
memory becomes the shadow, kept for the next sync with ``keep_staging=True`` (the two
buffers then take turns) and freed otherwise.
"""

import mmap
import weakref

import torch

from areal_fn.runtime.sync.group import SyncGroup

__all__ = ["MAPPED_MIN", "owns_storage", "release_staging"]

#: CPU staging buffers of at least this many bytes are mappings of their own.
MAPPED_MIN = 1 << 20
_MADV_FREE = getattr(mmap, "MADV_FREE", None)


class _Buffers:
    """Staging memory a group keeps from sync to sync: message buffers (by role, peer
    and slot) and shadows (by destination tensor)."""

    def __init__(self) -> None:
        self._flat: dict[tuple[str, int, int], torch.Tensor] = {}
        self._shadows: dict[str, torch.Tensor] = {}
        #: storage address of a mapped buffer -> its mapping
        self._maps: dict[int, mmap.mmap] = {}

    def _empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of staging on ``device``: a mapping of its own for large CPU buffers."""
        if device.type != "cpu" or nbytes < MAPPED_MIN or _MADV_FREE is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        t = torch.frombuffer(mapped, dtype=torch.uint8)  # holds the mapping while it lives
        self._maps[_storage(t)] = mapped
        return t

    def _drop(self, t: torch.Tensor | None) -> None:
        if t is not None:
            self._maps.pop(_storage(t), None)

    def flat(self, key: tuple[str, int, int], size: int, device: torch.device) -> torch.Tensor:
        buf = self._flat.get(key)
        if buf is None or buf.numel() < size or buf.device != device:
            self._drop(buf)
            buf = self._flat[key] = self._empty(size, device)
        return buf[:size]

    def shadow(self, name: str, live: torch.Tensor, *, whole: bool) -> torch.Tensor:
        """The shadow of live tensor ``name``: a copy of it unless the sync rewrites it whole."""
        s = self._shadows.get(name)
        if s is None or (s.shape, s.dtype, s.device) != (live.shape, live.dtype, live.device):
            self._drop(s)
            nbytes = live.numel() * live.element_size()
            s = self._empty(nbytes, live.device).view(live.dtype).view(live.shape)
            self._shadows[name] = s
        if not whole:
            s.copy_(live.detach())
        return s

    def swap_in(self, name: str, live: torch.Tensor) -> bool:
        """Commit shadow ``name`` into ``live`` by exchanging their storages, when ``live``
        owns its storage alone as far as can be seen (:func:`owns_storage`): ``live``
        then holds the shadow's memory (a mapped shadow leaves the staging for good, its
        pages never handed back) and its old memory becomes the shadow. False, with
        nothing changed, otherwise."""
        s = self._shadows[name]
        if not owns_storage(live):
            return False
        spare = torch.empty(0, dtype=live.dtype, device=live.device)
        spare.set_(live.untyped_storage(), 0, live.shape, live.stride())
        live.set_(s.untyped_storage(), s.storage_offset(), s.shape, s.stride())
        self._maps.pop(_storage(s), None)
        self._shadows[name] = spare
        return True

    def lend_back(self) -> None:
        """Give the mapped buffers' pages to the kernel (kept for reuse); free the rest."""
        self._flat = {k: t for k, t in self._flat.items() if _storage(t) in self._maps}
        self._shadows = {k: t for k, t in self._shadows.items() if _storage(t) in self._maps}
        for m in self._maps.values():
            m.madvise(_MADV_FREE)  # type: ignore[arg-type]


def owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor or parameter that is no view and spans its whole
    storage, contiguous: what :meth:`_Buffers.swap_in` exchanges. Other tensors sharing
    that storage (aliases, tied weights) cannot be seen from here."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t._base is None
        and t.numel() > 0
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (shared by every view of one buffer)."""
    return t.untyped_storage().data_ptr()


_BUFFERS: "weakref.WeakKeyDictionary[SyncGroup, _Buffers]" = weakref.WeakKeyDictionary()


def release_staging(group: SyncGroup) -> None:
    """Hand back the staging memory ``group`` keeps (see the module docstring): the next
    sync makes or reuses it."""
    got = _BUFFERS.get(group)
    if got is not None:
        got.lend_back()


def _buffers(group: SyncGroup) -> _Buffers:
    """The staging memory of ``group`` (freed with the group)."""
    got = _BUFFERS.get(group)
    if got is None:
        got = _BUFFERS[group] = _Buffers()
    return got
