"""Sync authentication: the group's secret, the members' proofs, the MACs of what they post.

**The secret.** Every member of a group holds the same secret: ``secret=`` of
:meth:`~areal_fn.runtime.sync.group.SyncGroup.from_store` /
:meth:`~areal_fn.runtime.sync.group.SyncGroup.from_world`, else the environment
variable :data:`SECRET_ENV` (which :func:`~areal_fn.runtime.launch.run_torchrun` sets
to a fresh random value for the processes it starts). A group over a store other
processes can reach (a ``TCPStore``, a ``FileStore``) without either is refused
(:func:`group_secret`); a store only this process can reach (a ``HashStore``) gets this
process's own random secret, which its threads share and no other process knows.

**Rendezvous.** Each member posts a random nonce and its proof,
``HMAC(secret, prefix | rank | nonce)`` (:func:`arrival`); every member checks every
other member's proof (:func:`check_arrivals`) before the group's connections are made,
and derives the group's session key from the secret, the prefix and all nonces
(:func:`session_key`), so that a generation's messages are worth nothing in another.

**Messages, votes, decisions.** Each bucket message carries
``HMAC(session, header | sync | src | dst | GMAC(payload))`` (:func:`message_tag`; the
payload's GMAC, :func:`payload_tag`, is AES-256-GCM's tag over the payload as
associated data with no plaintext, under a key derived from the session key and a
nonce derived from the sync, both ends and the header, so no two messages of a
session share a nonce), which the receiver checks before unpacking anything; each commit vote and the commit
decision carry a MAC over the sync, the rank or the decision's text (:func:`sign`).

What is not protected: the payload is not encrypted (anyone who reaches the
connections can read the weights); the store's progress counters and the transport's
connection set-up are not authenticated, so a process that reaches them can delay or
abort a sync (deny service), though never make a member accept bytes, a vote or a
decision it did not get from a holder of the secret.
"""

import hashlib
import hmac
import os
import secrets
from collections.abc import Sequence

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from areal_fn.errors import PlanError

#: The environment variable a group's secret is read from when ``secret=`` is not given.
SECRET_ENV = "AREAL_FN_SYNC_SECRET"
#: The shortest secret accepted (bytes).
MIN_SECRET_BYTES = 16
#: Bytes of a message's MAC (HMAC-SHA256).
TAG_BYTES = 32
_NONCE_BYTES = 16
#: The secret of groups over this process's own stores (threads share it, nobody else has it).
_PROCESS_SECRET = secrets.token_bytes(32)


def _base(store: dist.Store) -> dist.Store:
    """The store under any ``PrefixStore`` wrappers."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def is_in_process(store: dist.Store) -> bool:
    """True for a store no other process can reach (a ``HashStore``, under any prefixes)."""
    return isinstance(_base(store), dist.HashStore)


def group_secret(secret: bytes | str | None, store: dist.Store, prefix: str) -> bytes:
    """The secret of group ``prefix``: ``secret``, else ``$AREAL_FN_SYNC_SECRET``, else refused.

    A store only this process can reach needs none (its threads share a random one).
    """
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        if is_in_process(store):
            return _PROCESS_SECRET
        kind = type(_base(store)).__name__
        raise PlanError(
            f"sync group {prefix!r} over a {kind} has no secret: any process "
            f"that reaches the store could join it and post buckets or votes. Pass the same "
            f"secret= to every member, or set {SECRET_ENV} in every member's environment "
            f"(run_torchrun sets it for the processes it starts; for others, e.g. "
            f"export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))'))"
        )
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(key) < MIN_SECRET_BYTES:
        raise PlanError(
            f"sync group {prefix!r}: the secret has {len(key)} bytes, fewer than "
            f"{MIN_SECRET_BYTES}, so it can be guessed; use at least {MIN_SECRET_BYTES} random "
            "bytes, e.g. secrets.token_hex(32)"
        )
    return key


def _mac(key: bytes, *parts: bytes | str | int) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed (so no two lists of parts collide)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        b = p.encode() if isinstance(p, str) else p if isinstance(p, bytes) else str(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


def arrival(secret: bytes, prefix: str, rank: int) -> tuple[bytes, str]:
    """A fresh nonce and what member ``rank`` posts at rendezvous: ``nonce:proof`` in hex."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    return nonce, f"{nonce.hex()}:{_mac(secret, 'arrive', prefix, rank, nonce).hex()}"


def check_arrivals(
    secret: bytes, prefix: str, posted: dict[int, bytes]
) -> tuple[dict[int, bytes], list[int]]:
    """The nonces of the members whose posted proof verifies, and the ranks whose does not."""
    nonces: dict[int, bytes] = {}
    bad: list[int] = []
    for rank, value in sorted(posted.items()):
        nonce_hex, _, proof_hex = value.decode(errors="replace").partition(":")
        try:
            nonce, proof = bytes.fromhex(nonce_hex), bytes.fromhex(proof_hex)
        except ValueError:
            bad.append(rank)
            continue
        if hmac.compare_digest(proof, _mac(secret, "arrive", prefix, rank, nonce)):
            nonces[rank] = nonce
        else:
            bad.append(rank)
    return nonces, bad


def session_key(secret: bytes, prefix: str, nonces: list[bytes]) -> bytes:
    """The key of one group instance: the secret, its prefix, every member's nonce in order."""
    return _mac(secret, "session", prefix, *nonces)


def payload_view(buf: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 tensor, without a copy on the CPU."""
    host = buf if buf.device.type == "cpu" else buf.cpu()
    return host.numpy().data.cast("B")


def payload_tag(
    key: bytes, nonce_parts: Sequence[bytes | str | int], payload: memoryview | Sequence[memoryview]
) -> bytes:
    """GMAC (16 bytes) of ``payload``, one buffer or several read one after another.

    AES-256-GCM with no plaintext and the payload as associated data, under
    ``HMAC(key, "gmac")`` and the 96-bit nonce ``HMAC(key, "nonce", *nonce_parts)``.
    GCM's tag is a MAC only while no nonce repeats under one key: ``nonce_parts``
    must name the message uniquely within the session (the sync, both ends and the
    header, whose fields hold the version and the bucket). It runs at several times
    BLAKE3's speed on CPUs with AES and carry-less multiply instructions.
    """
    mac = Cipher(
        algorithms.AES(_mac(key, "gmac")), modes.GCM(_mac(key, "nonce", *nonce_parts)[:12])
    )
    enc = mac.encryptor()
    for part in (payload,) if isinstance(payload, memoryview) else payload:
        enc.authenticate_additional_data(part)
    enc.finalize()
    return enc.tag


def message_tag(
    key: bytes,
    *,
    seq: int,
    src: int,
    dst: int,
    header: memoryview,
    payload: memoryview | Sequence[memoryview],
) -> bytes:
    """The MAC of one bucket message: its header fields, sync, ends and payload's GMAC."""
    head = bytes(header)
    gmac = payload_tag(key, ("message", seq, src, dst, head), payload)
    return _mac(key, "message", seq, src, dst, head, gmac)


def sign(key: bytes, what: str, seq: int, text: str) -> str:
    """``text`` with its MAC appended after a newline (a vote's or a decision's)."""
    return f"{text}\n{_mac(key, what, seq, text).hex()}"


def verified(key: bytes, what: str, seq: int, value: bytes | str) -> str | None:
    """The text of a value :func:`sign` made with ``key``, or ``None`` if its MAC fails."""
    raw = value.decode(errors="replace") if isinstance(value, bytes) else value
    text, _, tag = raw.rpartition("\n")
    try:
        ok = hmac.compare_digest(bytes.fromhex(tag), _mac(key, what, seq, text))
    except ValueError:
        ok = False
    return text if ok else None
