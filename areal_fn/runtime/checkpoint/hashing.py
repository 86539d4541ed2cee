"""Checksums of checkpoint files: BLAKE3 while a save writes them, either algorithm when a load verifies.

A save hashes every data file in the same pass that writes it (:class:`HashingWriter`:
the bytes handed to ``write`` are hashed and written, nothing is read back); large
writes are cut into pieces, each hashed on a thread of the file's own while this
thread writes it (BLAKE3 and file writes both release the GIL), so on a machine with
a spare core the checksum costs no time. :func:`file_digest` hashes a file already on
disk: the small files a save writes otherwise (DCP's ``.metadata``, ``hf/``) and every
file a verified load checks (files in parallel, each on one thread), under the
algorithm its manifest names (``blake3``, or ``sha256`` for checkpoints saved before
BLAKE3 was used). Nothing here uses BLAKE3's multi-threaded mode: its shared thread
pool does not survive ``fork`` (a child that hashed again would hang).
"""

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import BinaryIO

import blake3

from areal_fn.plans.checkpoint.storage import Checksum, FileDigest

#: the checksum a save writes
SAVE_CHECKSUM: Checksum = "blake3"
#: writes at least this large are hashed on the file's hashing thread, piece by piece
_OVERLAP = 4 << 20
#: the piece hashed while the same piece is written
_PIECE = 8 << 20


def file_digest(path: Path, rel: str, algorithm: Checksum, *, sync: bool) -> FileDigest:
    """The size and ``algorithm`` checksum of the file at ``path`` (``rel``: its name in the
    checkpoint); with ``sync`` it is fsync'ed first."""
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
        if algorithm == "blake3":
            # from a memory map (no copy out of the page cache), on this thread only: the
            # library's shared thread pool would hang a process forked after using it
            h = blake3.blake3()
            h.update_mmap(path)
            digest = h.hexdigest()
        else:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    return FileDigest(path=rel, size=size, algorithm=algorithm, digest=digest)


class HashingWriter:
    """A file being written from its start, hashed (BLAKE3) in the same pass.

    ``write`` returns once its bytes are both written and hashed, so the caller may
    reuse its buffer; ``tell`` is the bytes written so far. Use it as a context manager
    (the hashing thread ends on exit) and read :meth:`hexdigest` after the last write.
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._h = blake3.blake3()
        self._pos = 0
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> "HashingWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def write(self, b: bytes | bytearray | memoryview) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if n < _OVERLAP:
            self._h.update(view)
            self._write_all(view)
        else:
            self._overlapped(view)
        self._pos += n
        return n

    def _overlapped(self, view: memoryview) -> None:
        """Hash each piece on the hashing thread (in order) while this thread writes it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash")
        pending: list[Future[object]] = []
        try:
            for start in range(0, len(view), _PIECE):
                piece = view[start : start + _PIECE]
                pending.append(self._pool.submit(self._h.update, piece))
                self._write_all(piece)
        finally:
            wait(pending)  # the buffer stays the caller's only after its last piece is hashed
        for p in pending:
            p.result()

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            done += self._f.write(view[done:])

    def flush(self) -> None:
        self._f.flush()

    def tell(self) -> int:
        return self._pos

    def hexdigest(self) -> str:
        return self._h.hexdigest()
