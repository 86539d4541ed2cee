"""Sync authentication (:mod:`areal_fn.runtime.sync.auth`), in one process.

The secret's sources and refusals, the rendezvous proofs, the MACs of messages, votes
and decisions, a message's header checked with its MAC
(:func:`~areal_fn.runtime.sync.messages._check_header`), and the secret
:func:`~areal_fn.runtime.launch.run_torchrun` gives each launch. The same facts across
processes and threads: ``test_weight_sync.py`` (its authentication section and the
``auth`` section of the torchrun launch).
"""

import hashlib
import hmac
import re
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from areal_fn.errors import PlanError
from areal_fn.runtime import launch
from areal_fn.runtime.sync import auth
from areal_fn.runtime.sync.executor import SyncGroup, open_store
from areal_fn.runtime.sync.messages import (
    FIELD_BYTES,
    HEADER_BYTES,
    _check_header,
    _HeaderMismatch,
    _Message,
    _message,
    _pack,
    _seal,
)
from tests.distributed.test_weight_sync import canonical, split_case

KEY = b"k" * 32
SECRET = b"s" * 32


# ---------------------------------------------------------------- the secret
def test_the_secret_comes_from_the_caller_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = dist.HashStore()
    monkeypatch.setenv(auth.SECRET_ENV, "from the environment, 32 bytes..")
    assert auth.group_secret(SECRET, store, "g/0") == SECRET
    assert auth.group_secret(SECRET.decode(), store, "g/0") == SECRET
    assert auth.group_secret(None, store, "g/0") == b"from the environment, 32 bytes.."


def test_an_in_process_store_without_a_secret_gets_this_process_s_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    store = dist.HashStore()
    wrapped = dist.PrefixStore("a", dist.PrefixStore("b", store))
    assert auth.is_in_process(store) and auth.is_in_process(wrapped)
    got = auth.group_secret(None, wrapped, "g/0")
    assert got == auth.group_secret(None, store, "h/0") and len(got) == 32


def test_a_tcp_store_without_a_secret_is_refused_before_anything_is_posted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=5.0)
    assert not auth.is_in_process(store)
    before = store.num_keys()
    with pytest.raises(
        PlanError,
        match=re.escape(
            "sync group 'weight_sync/0' over a TCPStore has no secret: any process that "
            "reaches the store could join it and post buckets or votes. Pass the same secret= "
            "to every member, or set AREAL_FN_SYNC_SECRET in every member's environment "
            "(run_torchrun sets it for the processes it starts;"
        ),
    ):
        SyncGroup.from_store(store, members=(0, 1), rank=0, connect_timeout_s=1)
    assert store.num_keys() == before
    # from_world's store is the world's, under a prefix: the message names what is under it
    with pytest.raises(PlanError, match=r"sync group 'w/0' over a TCPStore has no secret"):
        auth.group_secret(None, dist.PrefixStore("areal_fn.sync", store), "w/0")


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(
        PlanError,
        match=re.escape(
            "sync group 'g/0': the secret has 5 bytes, fewer than 16, so it can be guessed; use "
            "at least 16 random bytes, e.g. secrets.token_hex(32)"
        ),
    ):
        auth.group_secret("short", dist.HashStore(), "g/0")


# ---------------------------------------------------------------- rendezvous proofs
def test_a_proof_verifies_only_with_the_secret_the_prefix_and_the_rank() -> None:
    nonce, value = auth.arrival(SECRET, "g/0", 2)
    posted = value.encode()
    assert auth.check_arrivals(SECRET, "g/0", {2: posted}) == ({2: nonce}, [])
    assert auth.check_arrivals(b"t" * 32, "g/0", {2: posted}) == ({}, [2])
    assert auth.check_arrivals(SECRET, "g/1", {2: posted}) == ({}, [2])  # another generation
    assert auth.check_arrivals(SECRET, "g/0", {3: posted}) == ({}, [3])  # replayed as rank 3
    assert auth.check_arrivals(SECRET, "g/0", {1: b"1", 2: b"zz:zz"}) == ({}, [1, 2])
    assert auth.arrival(SECRET, "g/0", 2)[0] != nonce  # fresh nonces


def test_the_session_key_binds_the_prefix_and_every_nonce() -> None:
    a, b = b"a" * 16, b"b" * 16
    key = auth.session_key(SECRET, "g/0", [a, b])
    assert key != auth.session_key(SECRET, "g/0", [b, a])
    assert key != auth.session_key(SECRET, "g/1", [a, b])
    assert key != auth.session_key(b"t" * 32, "g/0", [a, b])
    assert len(key) == 32


# ---------------------------------------------------------------- votes, decisions
def test_a_signed_text_verifies_under_its_key_kind_and_sync_only() -> None:
    signed = auth.sign(KEY, "decision", 3, "abort: rank 2\nsaw a\ntimeout")
    assert auth.verified(KEY, "decision", 3, signed) == "abort: rank 2\nsaw a\ntimeout"
    assert auth.verified(KEY, "decision", 3, signed.encode()) is not None
    assert auth.verified(KEY, "decision", 4, signed) is None
    assert auth.verified(KEY, "vote", 3, signed) is None
    assert auth.verified(b"j" * 32, "decision", 3, signed) is None
    assert auth.verified(KEY, "decision", 3, signed.replace("rank 2", "rank 1")) is None
    for forged in ("commit", "commit\n", "commit\nzz", ""):
        assert auth.verified(KEY, "decision", 3, forged) is None


# ---------------------------------------------------------------- messages
def _one_message() -> tuple[_Message, dict[str, torch.Tensor]]:
    case = split_case()
    b = case.buckets.buckets[0]
    ts = [t for t in b.transfers if t.src == 0 and t.dst == 2]
    src = case.sources(0, canonical(60))
    return _message(0, 2, ts, [src[t.src_tensor].dtype for t in ts]), src


def _sealed(m: _Message, src: dict[str, torch.Tensor], key: bytes = KEY) -> torch.Tensor:
    buf = _pack(m, 7, 0, src, torch.device("cpu"))
    _seal(m, buf, key, 0)
    return buf


def test_message_tags_cover_every_field_and_every_payload_byte() -> None:
    m, src = _one_message()
    buf = _sealed(m, src)
    view = auth.payload_view
    tag = auth.message_tag(
        KEY, seq=0, src=0, dst=2, header=view(buf[:FIELD_BYTES]), payload=view(buf[HEADER_BYTES:])
    )
    assert bytes(view(buf[FIELD_BYTES:HEADER_BYTES])) == tag and HEADER_BYTES == 80
    others = [
        {"seq": 1, "src": 0, "dst": 2},
        {"seq": 0, "src": 1, "dst": 2},
        {"seq": 0, "src": 0, "dst": 3},
    ]
    for kw in others:
        got = auth.message_tag(
            KEY, **kw, header=view(buf[:FIELD_BYTES]), payload=view(buf[HEADER_BYTES:])
        )
        assert got != tag, kw
    for i in (0, 8, FIELD_BYTES - 1, HEADER_BYTES, m.size - 1):
        flipped = buf.clone()
        flipped[i] ^= 1
        got = auth.message_tag(
            KEY,
            seq=0,
            src=0,
            dst=2,
            header=view(flipped[:FIELD_BYTES]),
            payload=view(flipped[HEADER_BYTES:]),
        )
        assert got != tag, i


def _hmac_parts(key: bytes, *parts: bytes | str) -> bytes:
    """HMAC-SHA256 over length-prefixed parts, written out here from the module's rule."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little") + b)
    return h.digest()


def test_the_payload_tag_is_aes_gcm_over_its_bytes_in_order() -> None:
    key = bytes(range(32))
    data = torch.randint(0, 256, (9 << 20,), dtype=torch.uint8)
    view = auth.payload_view(data)
    # the one-shot AES-GCM of the library, no plaintext, the payload as associated data
    nonce = _hmac_parts(key, "nonce", "message", b"ab")[:12]
    want = AESGCM(_hmac_parts(key, "gmac")).encrypt(nonce, b"", data.numpy().tobytes())
    assert auth.payload_tag(key, ("message", b"ab"), view) == want
    # the same bytes in several buffers, read in order, give the same tag
    parts = [auth.payload_view(p) for p in torch.tensor_split(data, [5, 1 << 20, 3 << 20])]
    assert auth.payload_tag(key, ("message", b"ab"), parts) == want
    assert auth.payload_tag(key, ("message", b"ab"), parts[::-1]) != want
    # another message (nonce) or another session key: another tag
    assert auth.payload_tag(key, ("message", b"ac"), view) != want
    assert auth.payload_tag(bytes(32), ("message", b"ab"), view) != want
    data[(4 << 20) + 1] ^= 1  # one byte, in the middle
    assert auth.payload_tag(key, ("message", b"ab"), auth.payload_view(data)) != want


AUTH_FAILS = re.escape(
    "the message fails authentication: its MAC does not match this group's key over the "
    "header (version, bucket, sender, receiver, sync) and the payload's GMAC, so a process "
    "without the group's secret sent it, or its bytes were altered on the way. Refused before "
    "unpacking; live tensors keep the previous version. Give every member the same secret and "
    "keep other processes off the group's store and ports"
)


def test_a_sealed_message_passes_and_any_change_is_refused() -> None:
    m, src = _one_message()
    buf = _sealed(m, src)
    _check_header(m, 7, 0, buf, KEY, 0)
    # the payload altered on the way
    altered = buf.clone()
    altered[-1] ^= 0xFF
    with pytest.raises(_HeaderMismatch, match=AUTH_FAILS):
        _check_header(m, 7, 0, altered, KEY, 0)
    # another sync of the same group (a replay), another key
    with pytest.raises(_HeaderMismatch, match=AUTH_FAILS):
        _check_header(m, 7, 0, buf, KEY, 1)
    with pytest.raises(_HeaderMismatch, match=AUTH_FAILS):
        _check_header(m, 7, 0, buf, b"j" * 32, 0)


def test_a_forged_header_of_the_right_format_is_refused() -> None:
    """The right magic, version, plan and dtype digests; other values; a MAC under a key
    that is not the group's."""
    m, src = _one_message()
    forged = _sealed(m, {k: v + 1.0 for k, v in src.items()}, key=b"\x00" * 32)
    assert torch.equal(forged[:FIELD_BYTES], _sealed(m, src)[:FIELD_BYTES])
    with pytest.raises(_HeaderMismatch, match=AUTH_FAILS):
        _check_header(m, 7, 0, forged, KEY, 0)


def test_an_authentic_header_is_then_checked_against_the_plan() -> None:
    m, src = _one_message()
    buf = _sealed(m, src)
    with pytest.raises(
        _HeaderMismatch, match="the sender syncs version 7, this rank expects version 8"
    ):
        _check_header(m, 8, 0, buf, KEY, 0)
    with pytest.raises(_HeaderMismatch, match="the message has no sync header"):
        _check_header(m, 7, 0, torch.zeros_like(buf), KEY, 0)


# ---------------------------------------------------------------- the launcher
class _FakePopen:
    """Stands in for the torchrun process: records the environment it was given."""

    envs: ClassVar[list[dict[str, str]]] = []

    def __init__(self, command: Any, *, env: dict[str, str], **kw: Any) -> None:
        self.envs.append(env)
        self.returncode = 0
        self.pid = -1

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        return "", None


def test_the_launcher_gives_each_launch_a_fresh_secret_unless_one_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.setattr(launch.subprocess, "Popen", _FakePopen)
    _FakePopen.envs.clear()
    for _ in range(2):
        launch.run_torchrun("worker.py", nproc=1, check=False)
    launch.run_torchrun("worker.py", nproc=1, check=False, env={auth.SECRET_ENV: "mine" * 8})
    monkeypatch.setenv(auth.SECRET_ENV, "inherited" * 4)
    launch.run_torchrun("worker.py", nproc=1, check=False)
    first, second, given, inherited = (e[auth.SECRET_ENV] for e in _FakePopen.envs)
    assert re.fullmatch(r"[0-9a-f]{64}", first) and re.fullmatch(r"[0-9a-f]{64}", second)
    assert first != second
    assert (given, inherited) == ("mine" * 8, "inherited" * 4)
