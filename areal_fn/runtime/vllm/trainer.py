"""The trainer's side of a weight update into vLLM: one call per version.

::

    sync = VllmWeightSync(engine, "http://127.0.0.1:8000")   # every trainer rank
    report = sync.update(step)                                # every trainer rank

``engine`` is an :class:`~areal_fn.runtime.engines.fsdp2.Fsdp2Engine` or a
:class:`~areal_fn.runtime.engines.megatron.MegatronEngine` of any strategy; the
deployment is a vLLM server's address or a ``vllm.LLM`` whose weight-transfer backend
is ``areal_fn`` (:mod:`areal_fn.runtime.vllm.backend`). Every trainer rank calls both;
trainer rank 0 alone talks to vLLM.

Connecting: trainer rank 0 opens a store (a ``TCPStore`` on ``host``, a free port), asks
vLLM to check the connection (``/init_weight_transfer_engine`` with ``check_only``: the
workers rebuild the trainer's layout from its recipe and check the digests), then asks it
to join (the same request) while every trainer rank joins the sync group: trainer ranks
are plan ranks ``0 .. T-1``, vLLM's ranks ``T ..``. Every member proves the group's
secret (``secret=`` / ``$AREAL_FN_SYNC_SECRET``; the server's workers read theirs from
their environment). vLLM's rank 0 posts the deployment's facts (``t``, ``p``, dtype),
signed, so the trainer plans against vLLM's own parallel config.

An update (:meth:`VllmWeightSync.update`): ``/pause``, ``/start_weight_update``,
``/update_weights`` (each vLLM rank receives its planned boxes while the trainer ranks
send theirs; the workers commit atomically, then load), ``/finish_weight_update``,
``/update_weight_version``, ``/resume``. A failed update leaves vLLM serving the
weights it had, resumes generation and raises; the next update reconnects (a new
group).
"""

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed as dist

from areal_fn.errors import PlanError
from areal_fn.plans.transfer import bucket
from areal_fn.runtime.sync.executor import SyncGroup, send_and_receive
from areal_fn.runtime.sync.group import ABORT, SyncError, open_store
from areal_fn.runtime.vllm.deployment import VllmError, as_deployment
from areal_fn.runtime.vllm.recipe import layout_digest, model_digest, trainer_recipe
from areal_fn.runtime.vllm.targets import Targets, default_mode, modes

__all__ = ["VllmUpdateReport", "VllmWeightSync"]


@attrs.frozen(kw_only=True)
class VllmUpdateReport:
    """One update, as every trainer rank sees it (byte counts over all trainer ranks)."""

    version: int
    #: payload bytes the trainer ranks sent, all together
    bytes_sent: int
    #: the least any resharding must move, from the two layouts alone
    lower_bound: int
    #: "sharded" or "full" (:mod:`areal_fn.runtime.vllm.targets`)
    mode: str
    buckets: int
    seconds: float
    #: vLLM's answer to ``/weight_info`` after the update
    weight_version: str | None


class VllmWeightSync:
    """A trainer engine connected to a vLLM deployment (see the module doc)."""

    def __init__(
        self,
        engine: Any,
        deployment: Any,
        *,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        connect_timeout_s: float = 120.0,
        bucket_bytes: int = 64 << 20,
        pause_mode: str = "keep",
        secret: bytes | str | None = None,
    ) -> None:
        self.engine = engine
        self.deployment = as_deployment(deployment)
        self.host = host
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.secret = secret
        self.recipe = trainer_recipe(engine)  # refuses other engines
        self.src = engine.layout
        self.trainer_ranks = self.src.world_size
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.trainer_ranks:
            raise PlanError(
                f"the trainer's layout has {self.trainer_ranks} ranks but the running world "
                f"{world}; every rank of the engine's world calls VllmWeightSync"
            )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group: SyncGroup | None = None
        self.facts: dict[str, Any] = {}
        self._store: Any = None
        self.connect()

    # -- connecting ---------------------------------------------------------------
    def connect(self) -> None:
        """Form a new sync group with the deployment (collective over the trainer ranks)."""
        self.close()
        spec = self.engine.spec
        head: list[Any] = [None, None, None, None]
        if self.rank == 0:
            try:
                # a trainer that died in the middle of an update left generation paused
                self.deployment.call("resume")
                n = self.deployment.world_size()
                store = open_store(self.host, 0, is_master=True, timeout_s=self.connect_timeout_s)
                name = f"areal_fn.vllm/{secrets.token_hex(8)}"
                head = [n, store.port, name, None]
                self._store = store
                self._info = self._init_info(store.port, name)
                self.deployment.call(
                    "init_weight_transfer_engine",
                    {"init_info": {**self._info, "check_only": True}},
                )
            except Exception as e:
                head[3] = f"{type(e).__name__}: {e}"
        head = _broadcast(head)
        n, port, name, error = head
        if error is not None:
            raise VllmError(f"vLLM refused the connection: {error}")
        if self.rank != 0:
            self._store = open_store(
                self.host, port, is_master=False, timeout_s=self.connect_timeout_s
            )
        members = range(self.trainer_ranks + n)
        joined: list[BaseException] = []
        thread = None
        if self.rank == 0:
            thread = _in_thread(
                lambda: self.deployment.call(
                    "init_weight_transfer_engine", {"init_info": self._info}
                ),
                joined,
            )
        try:
            group = SyncGroup.from_store(
                self._store,
                members=members,
                rank=self.rank,
                timeout_s=self.timeout_s,
                connect_timeout_s=self.connect_timeout_s,
                name=name,
                secret=self.secret,
            )
        finally:
            if thread is not None:
                thread.join()
        if joined:
            group.abort()
            raise VllmError(f"vLLM failed to join the sync group: {joined[0]}") from joined[0]
        self.facts = json.loads(group.read_signed("deployment"))
        self.targets = Targets(
            spec=spec,
            src=self.src,
            trainer_ranks=self.trainer_ranks,
            tp=int(self.facts["tp"]),
            pp=int(self.facts["pp"]),
            trainer_rank=self.rank,
        )
        self._bounds: dict[str, int] = {}
        self.group = group

    def _init_info(self, port: int, name: str) -> dict[str, Any]:
        return {
            "store_host": self.host,
            "store_port": port,
            "group": name,
            "trainer_ranks": self.trainer_ranks,
            "trainer_layout": self.recipe,
            "layout_digest": layout_digest(self.src),
            "model_digest": model_digest(self.engine.spec),
            "timeout_s": self.timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
        }

    def close(self) -> None:
        if self.group is not None:
            self.group.abort()
        self.group = None

    # -- one update ---------------------------------------------------------------
    def update(self, version: int, *, mode: str | None = None) -> VllmUpdateReport:
        """Push the engine's current weights to vLLM as ``version`` (collective).

        ``mode`` (:mod:`~areal_fn.runtime.vllm.targets`): ``"sharded"`` (each vLLM rank
        receives its parameters' boxes; the default where ``vllm_layout`` describes the
        family) or ``"full"`` (whole tensors to every vLLM rank, vLLM's own loaders)."""
        if self.group is None or self.group.broken:
            self.connect()
        mode = default_mode(self.engine.spec) if mode is None else mode
        if mode not in modes(self.engine.spec):
            raise PlanError(
                f"mode={mode!r} is not one this model supports: {list(modes(self.engine.spec))}"
            )
        if mode not in self._bounds:  # from the layouts alone, not from the plan
            self._bounds[mode] = self.targets.lower_bound(mode)
        group = self.group
        assert group is not None
        t0 = time.perf_counter()
        tensors = self.engine.local_state()
        target = _DTYPE_NAMES.get(str(self.facts.get("dtype")))
        wire = (
            target
            if target is not None and any(t.dtype != target for t in tensors.values())
            else None
        )
        self._rank0_steps(
            version, ("pause", {"mode": self.pause_mode}), ("start_weight_update", None)
        )
        report = self._send(group, version, tensors, wire, mode)
        status = self._rank0_steps(
            version,
            ("finish_weight_update", None),
            ("update_weight_version", {"new_version": str(version)}),
            ("weight_info", None),
        )
        sent = torch.tensor([report.bytes_sent], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(sent)
        return VllmUpdateReport(
            version=version,
            bytes_sent=int(sent.item()),
            lower_bound=self._bounds[mode],
            mode=mode,
            buckets=report.buckets,
            seconds=time.perf_counter() - t0,
            weight_version=None if status is None else status.get("weight_version"),
        )

    def _rank0_steps(self, version: int, *calls: tuple[str, dict[str, Any] | None]) -> Any:
        """Rank 0 makes ``calls`` in order (the last one's answer is returned on every rank);
        a failure resumes generation and raises on every rank."""
        status: list[Any] = [None, None]
        if self.rank == 0:
            try:
                for method, body in calls:
                    status[1] = self.deployment.call(method, body)
            except Exception as e:
                status[0] = f"{type(e).__name__}: {e}"
                with contextlib.suppress(Exception):
                    self.deployment.call("resume")
            if calls[-1][0] == "weight_info":  # the update is over: generation goes on
                with contextlib.suppress(Exception):
                    self.deployment.call("resume")
        status = _broadcast(status)
        if status[0] is not None:
            self.close()
            raise VllmError(f"vLLM failed the update to version {version}: {status[0]}")
        return status[1]

    def _send(
        self,
        group: SyncGroup,
        version: int,
        tensors: dict[str, torch.Tensor],
        wire: Any,
        mode: str,
    ) -> Any:
        """The trainer ranks send while rank 0 has vLLM receive (``/update_weights``)."""
        plan, _ = self.targets.plan(mode)
        buckets = bucket(plan, self.bucket_bytes, version=version)
        failed: list[BaseException] = []
        thread = None
        seq = group.syncs
        if self.rank == 0:
            info: dict[str, Any] = {
                "version": version,
                "bucket_bytes": self.bucket_bytes,
                "mode": mode,
            }
            if wire is not None:
                info["wire_dtype"] = str(wire).removeprefix("torch.")

            def post() -> None:
                try:
                    self.deployment.call("update_weights", {"update_info": info})
                except BaseException as e:
                    # fail the trainer's ranks at once instead of at their timeout
                    with contextlib.suppress(Exception):
                        group._decide(seq, f"{ABORT}: vLLM refused the update: {e}")
                    raise

            thread = _in_thread(post, failed)
        try:
            report = send_and_receive(
                buckets, src_tensors=tensors, dst_tensors={}, group=group, wire_dtype=wire
            )
        except (SyncError, PlanError):
            self.close()
            raise
        finally:
            if thread is not None:
                thread.join()
        error = _broadcast([f"{type(failed[0]).__name__}: {failed[0]}" if failed else None])
        if error[0] is not None:
            self.close()
            raise VllmError(f"vLLM failed the update to version {version}: {error[0]}")
        return report


_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _broadcast(values: list[Any]) -> list[Any]:
    """Rank 0's ``values`` on every trainer rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        out = list(values)
        dist.broadcast_object_list(out, src=0)
        return out
    return values


def _in_thread(fn: Callable[[], Any], errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
