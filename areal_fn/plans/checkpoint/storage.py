"""A checkpoint's files: their checksums, and where its entries lie in them.

:class:`FileDigest` is one file's size and checksum, with the algorithm named
(:data:`CHECKSUMS`: ``blake3``, what saves write; ``sha256``, what older saves wrote
and loads still verify); in JSON the algorithm is the checksum's key
(``{"path": ..., "size": ..., "blake3": ...}``), so an older manifest reads unchanged.

torch DCP locates every entry (a chunk of a parameter or moment, a scalar state, a
byte entry) in its ``.metadata`` file, a Python pickle; unpickling a file runs any
code it holds. The manifest records the same locations as JSON (:class:`StoredItem`:
key, chunk offsets, file, byte offset, length), so that a load builds DCP's read plan
from the manifest and never unpickles anything. :func:`check_storage` refuses a list
that does not locate exactly the entries the manifest's tensors imply, each inside a
listed data file. Pure: no files, no environment, no clock.
"""

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from areal_fn.errors import CheckpointError

#: the data files DCP writes (``__<process>_<file>.distcp``): the only files an entry may lie in
DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")


def _ints(value: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class StoredItem:
    """One DCP entry: ``key`` (``offsets``: its chunk's first element; ``()`` for a scalar
    state or a byte entry), stored as ``length`` bytes at byte ``offset`` of ``file``."""

    key: str
    offsets: tuple[int, ...] = attrs.field(converter=_ints)
    file: str
    offset: int = attrs.field(validator=attrs.validators.ge(0))
    length: int = attrs.field(validator=attrs.validators.ge(0))

    def to_json(self) -> dict[str, object]:
        return {
            "key": self.key,
            "offsets": list(self.offsets),
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> "StoredItem":
        return cls(
            key=str(raw["key"]),
            offsets=raw["offsets"],
            file=str(raw["file"]),
            offset=int(raw["offset"]),
            length=int(raw["length"]),
        )


def check_inside(_inst: object, _attr: object, value: str) -> None:
    """``CheckpointError`` unless ``value`` is a path inside the checkpoint directory (an
    ``attrs`` validator: a manifest never makes a load read a file elsewhere)."""
    if value.startswith("/") or any(p in ("", ".", "..") for p in value.split("/")):
        raise CheckpointError(
            f"file {value!r} is not a path inside the checkpoint directory (no '..', not absolute)"
        )


#: a checksum algorithm of a checkpoint file
Checksum = Literal["blake3", "sha256"]
#: the checksum algorithms a manifest may name, the one saves use first
CHECKSUMS: tuple[Checksum, ...] = ("blake3", "sha256")


def _check_hex64(inst: "FileDigest", _attr: object, value: str) -> None:
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise CheckpointError(
            f"{inst.path}: {inst.algorithm} {value!r} is not 64 lowercase hex digits"
        )


@attrs.frozen(kw_only=True)
class FileDigest:
    """A file of the checkpoint (path relative to its directory), its size and its
    checksum (``digest``, 32 bytes in hex) under ``algorithm``."""

    path: str = attrs.field(validator=check_inside)
    size: int = attrs.field(validator=attrs.validators.ge(0))
    algorithm: Checksum = attrs.field(validator=attrs.validators.in_(CHECKSUMS))
    digest: str = attrs.field(validator=_check_hex64)

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size, self.algorithm: self.digest}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> "FileDigest":
        named = [a for a in CHECKSUMS if a in raw]
        if len(named) != 1:
            raise CheckpointError(
                f"file {raw.get('path')!r} names {len(named)} checksums ({named}); each file "
                f"entry names exactly one of {list(CHECKSUMS)}: the manifest is malformed"
            )
        return cls(
            path=str(raw["path"]),
            size=int(raw["size"]),
            algorithm=named[0],
            digest=str(raw[named[0]]),
        )


def check_storage(
    items: Iterable[StoredItem],
    *,
    expected: Iterable[tuple[str, tuple[int, ...]]],
    sizes: Mapping[str, int],
) -> None:
    """``CheckpointError`` unless ``items`` locate each ``(key, offsets)`` of ``expected``
    exactly once, each inside a DCP data file of ``sizes`` (path -> size; empty: not
    checked, the files are not known yet)."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for it in items:
        where = f"storage entry {it.key!r} at {it.offsets}"
        if (it.key, it.offsets) in seen:
            raise CheckpointError(f"{where} is listed twice; the manifest is inconsistent")
        seen.add((it.key, it.offsets))
        if not DATA_FILE.match(it.file):
            raise CheckpointError(
                f"{where} lies in {it.file!r}, not a DCP data file (__<n>_<m>.distcp); the "
                "manifest is inconsistent"
            )
        if sizes and it.offset + it.length > sizes.get(it.file, -1):
            raise CheckpointError(
                f"{where} takes bytes {it.offset}..{it.offset + it.length} of {it.file}, which "
                f"the manifest lists with {sizes.get(it.file, 'no')} bytes; the manifest is "
                "inconsistent"
            )
    want = set(expected)
    missing, extra = sorted(want - seen), sorted(seen - want)
    problems = [
        f"{what} {len(keys)} entries {how} ({', '.join(f'{k} at {o}' for k, o in keys[:3])}"
        f"{', ...' if len(keys) > 3 else ''})"
        for what, how, keys in (
            ("misses", "the tensors imply", missing),
            ("locates", "no tensor implies", extra),
        )
        if keys
    ]
    if problems:
        raise CheckpointError(f"storage {' and '.join(problems)}; the manifest is inconsistent")
