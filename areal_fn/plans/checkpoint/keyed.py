"""The keyed digest of a checkpoint manifest: which team's job saved it.

The manifest's ``manifest_sha256`` is a checksum, not a proof of origin: anyone who
edits a checkpoint can recompute it. ``manifest_hmac`` is an HMAC-SHA256 of the
manifest's content (:meth:`~areal_fn.plans.checkpoint.manifest.CheckpointManifest.content_text`:
every field, the sha256 of every file included) under a key the saving job holds;
only a holder of the key can make one that matches. :func:`with_keyed_digest` adds
it, :func:`check_keyed_digest` refuses a manifest without it or with another. The key
comes from the caller (the CLI reads it from ``AREAL_FN_CHECKPOINT_KEY``). Pure: no
files, no environment, no clock.
"""

import hashlib
import hmac

import attrs

from areal_fn.errors import CheckpointError
from areal_fn.plans.checkpoint.manifest import CheckpointManifest
from areal_fn.typecheck import beartype

#: the shortest key a keyed digest accepts, in bytes
MIN_KEY_BYTES = 16
#: where the ``areal-fn`` command reads the key from (the library takes it as an argument)
KEY_ENV = "AREAL_FN_CHECKPOINT_KEY"


def check_key(key: bytes) -> None:
    """``CheckpointError`` unless ``key`` is long enough to keep a keyed digest from being guessed."""
    if len(key) < MIN_KEY_BYTES:
        raise CheckpointError(
            f"the checkpoint key has {len(key)} bytes; a keyed digest needs at least "
            f"{MIN_KEY_BYTES} (e.g. 32 random bytes: openssl rand -hex 32)"
        )


def keyed_digest(manifest: CheckpointManifest, key: bytes) -> str:
    """HMAC-SHA256 of ``manifest``'s content under ``key``, as 64 hex digits.

    Not type-checked: the background save calls it, and the type checker draws from
    python's ``random``, which the training thread owns.
    """
    return hmac.new(key, manifest.content_text().encode(), hashlib.sha256).hexdigest()


def with_keyed_digest(manifest: CheckpointManifest, key: bytes) -> CheckpointManifest:
    """``manifest`` carrying its keyed digest under ``key`` (not type-checked, as above)."""
    check_key(key)
    return attrs.evolve(manifest, keyed_digest=keyed_digest(manifest, key))


@beartype
def is_keyed_by(manifest: CheckpointManifest, key: bytes) -> bool:
    """True when ``manifest`` carries a keyed digest that ``key`` reproduces."""
    check_key(key)
    got = manifest.keyed_digest
    return got is not None and hmac.compare_digest(got, keyed_digest(manifest, key))


@beartype
def check_keyed_digest(
    manifest: CheckpointManifest, key: bytes, *, source: str = "checkpoint"
) -> None:
    """``CheckpointError`` unless ``manifest`` carries the keyed digest ``key`` gives."""
    if is_keyed_by(manifest, key):
        return
    if manifest.keyed_digest is None:
        raise CheckpointError(
            f"{source} carries no keyed digest (manifest_hmac): it was saved without a key, so "
            "nothing shows which job wrote it; open it without a key (hmac_key=None; on the "
            f"command line, unset {KEY_ENV}) only if you trust where it came from"
        )
    raise CheckpointError(
        f"{source}: manifest_hmac does not match the key given: the checkpoint was not saved "
        "with this key (it comes from another job, or its manifest was changed after the "
        "save); do not use it, or check that the key is the one its job saved with"
    )
