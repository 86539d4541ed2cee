"""The ``areal_fn`` weight-transfer backend, inside every vLLM worker.

vLLM loads it by name (``--weight-transfer-config '{"backend": "areal_fn"}'`` or
``LLM(..., weight_transfer_config=WeightTransferConfig(backend="areal_fn"))``) once the
plugin (:mod:`areal_fn.runtime.vllm.plugin`, entry point ``vllm.general_plugins``) has
registered it; vLLM itself is not patched.

Each worker is one destination rank of a transfer plan from the trainer's layout
(sent as a recipe, :mod:`areal_fn.runtime.vllm.recipe`) to the deployment's
:func:`~areal_fn.layouts.vllm.vllm_layout` (its ``t`` and ``p`` read from vLLM's own
parallel config). It plans its own rows (pure), joins the trainer's authenticated sync
group (:class:`~areal_fn.runtime.sync.group.SyncGroup`; the secret comes from
``$AREAL_FN_SYNC_SECRET`` in the server's environment, never over HTTP), and receives
exactly the canonical boxes its parameters are made of. A sync commits atomically into
model-format buffers; only then are they put into the model (:mod:`.apply`), so a
failed or refused update leaves the served weights as they were.

Requests (``init_info`` of ``/init_weight_transfer_engine``, ``update_info`` of
``/update_weights``) are plain JSON; a malformed one is refused with ``ValueError``
naming the field, before anything changes.
"""

import inspect
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.transfer import bucket
from areal_fn.runtime.sync.executor import SyncGroup, SyncReport, send_and_receive
from areal_fn.runtime.sync.group import _fail, open_store
from areal_fn.runtime.vllm.apply import apply_full, apply_reload, live_tensors
from areal_fn.runtime.vllm.backend_name import AREAL_FN_BACKEND
from areal_fn.runtime.vllm.recipe import layout_digest, layout_from_recipe, model_digest
from areal_fn.runtime.vllm.targets import Targets, default_mode, modes

_LOG = logging.getLogger("areal_fn.vllm")

__all__ = [
    "AREAL_FN_BACKEND",
    "ArealFnInitInfo",
    "ArealFnUpdateInfo",
    "ArealFnWeightTransferEngine",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"areal_fn weight transfer: {what}")


@dataclass(kw_only=True)
class ArealFnInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``/init_weight_transfer_engine``."""

    #: the trainer's store (``open_store``), hosting the sync group
    store_host: str
    store_port: int
    #: the sync group's name, new for each connection of a trainer
    group: str
    #: trainer ranks: plan ranks ``0 .. trainer_ranks-1``; vLLM ranks follow
    trainer_ranks: int
    #: the trainer's layout as data (:func:`~areal_fn.runtime.vllm.recipe.trainer_recipe`)
    trainer_layout: dict[str, Any]
    #: digests the workers check: the trainer's layout and the model's canonical tensors
    layout_digest: str
    model_digest: str
    timeout_s: float = 60.0
    connect_timeout_s: float = 120.0
    #: validate everything, form no group (the trainer's pre-flight)
    check_only: bool = False
    #: "auto" (reload on CPU, in place elsewhere), "reload" or "in_place"
    apply: str = "auto"

    def __post_init__(self) -> None:
        _check(
            isinstance(self.store_host, str) and bool(self.store_host),
            "store_host must be a host name",
        )
        _check(
            isinstance(self.store_port, int) and 0 < self.store_port < 65536,
            f"store_port={self.store_port!r} must be a TCP port (1-65535)",
        )
        _check(isinstance(self.group, str) and 0 < len(self.group) <= 200, "group must be a name")
        _check(
            isinstance(self.trainer_ranks, int) and self.trainer_ranks >= 1,
            f"trainer_ranks={self.trainer_ranks!r} must be a positive int",
        )
        _check(isinstance(self.trainer_layout, dict), "trainer_layout must be an object")
        for name in ("timeout_s", "connect_timeout_s"):
            v = getattr(self, name)
            _check(
                isinstance(v, int | float) and 0 < v <= 3600,
                f"{name}={v!r} must be seconds in (0, 3600]",
            )
        _check(
            self.apply in ("auto", "reload", "in_place"),
            f"apply={self.apply!r} must be 'auto', 'reload' or 'in_place'",
        )


@dataclass(kw_only=True)
class ArealFnUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``/update_weights``: one versioned update."""

    version: int
    bucket_bytes: int = 64 << 20
    #: the dtype on the wire (the trainer casts to it), or None for the trainer's own
    wire_dtype: str | None = None
    #: "sharded": each rank receives its parameters' boxes (vllm_layout); "full": each
    #: rank receives whole canonical tensors, loaded by vLLM's own loaders (any family)
    mode: str = "sharded"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(
            isinstance(self.version, int)
            and not isinstance(self.version, bool)
            and self.version >= 0,
            f"version={self.version!r} must be a non-negative int",
        )
        _check(
            isinstance(self.bucket_bytes, int) and self.bucket_bytes >= 1024,
            f"bucket_bytes={self.bucket_bytes!r} must be an int >= 1024",
        )
        _check(
            self.wire_dtype is None or self.wire_dtype in _DTYPES,
            f"wire_dtype={self.wire_dtype!r} must be one of {sorted(_DTYPES)} or null",
        )
        _check(self.mode in ("sharded", "full"), f"mode={self.mode!r} must be 'sharded' or 'full'")


class ArealFnWeightTransferEngine(WeightTransferEngine[ArealFnInitInfo, ArealFnUpdateInfo]):
    """Receives planned canonical boxes over an areal_fn sync group (see the module doc)."""

    init_info_cls = ArealFnInitInfo
    update_info_cls = ArealFnUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._group: SyncGroup | None = None
        self._targets: Targets = None  # type: ignore[assignment]  # set by init
        self._in_place = False
        #: the last version this worker committed (None: the weights it loaded)
        self.version: int | None = None
        self.last_report: SyncReport | None = None

    # -- failures: only the last worker raises ------------------------------------------
    def _surface(self, error: Exception, *, clear_update_flag: bool) -> None:
        """Raise ``error`` on the deployment's last worker only.

        vLLM's multiprocess executor reads its workers' replies to a call in rank order
        and stops at the first failure, leaving the later workers' replies queued, where
        they would answer the next calls (every later call would get the reply of the
        call before it). So a failure every worker sees is raised by the last worker
        alone; the others log it, clear vLLM's update-in-progress flag as a raise would
        have (``clear_update_flag``), and return.
        """
        from vllm.distributed.parallel_state import get_world_group

        world = get_world_group()
        if world.rank_in_group == world.world_size - 1:
            raise error
        _LOG.warning("areal_fn weight transfer (rank %d): %s", world.rank_in_group, error)
        if clear_update_flag:
            worker = _calling_worker(self)
            if worker is not None:
                worker._weight_update_active = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            super().update_weights(update_info)
        except Exception as e:
            self._surface(e, clear_update_flag=True)

    # -- vLLM's hooks ---------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> ArealFnInitInfo:
        try:
            _check(isinstance(init_dict, dict), "init_info must be a JSON object")
            return super().parse_init_info(init_dict)
        except Exception as e:
            self._surface(e, clear_update_flag=False)
            return None  # type: ignore[return-value]  # init_transfer_engine skips it

    def parse_update_info(self, update_dict: dict[str, Any]) -> ArealFnUpdateInfo:
        _check(isinstance(update_dict, dict), "update_info must be a JSON object")
        return super().parse_update_info(update_dict)

    def init_transfer_engine(self, init_info: ArealFnInitInfo) -> None:
        if init_info is None:  # refused by parse_init_info (the last worker raised)
            return
        try:
            self._init(init_info)
        except Exception as e:
            self._surface(e, clear_update_flag=False)

    def _init(self, init_info: ArealFnInitInfo) -> None:
        spec = model_from_hf_config(self.model_config.hf_config.to_dict())
        _check(
            init_info.model_digest == model_digest(spec),
            "the trainer's model has other canonical tensors (names or shapes) than the "
            f"model this server serves ({self.model_config.model}); serve the trainer's "
            "model, or train the served one",
        )
        src = layout_from_recipe(spec, init_info.trainer_layout)
        _check(
            init_info.layout_digest == layout_digest(src),
            "the trainer's layout rebuilt from its recipe differs from the one the trainer "
            "holds (another areal_fn version on one side?); use the same areal_fn release",
        )
        _check(
            src.world_size == init_info.trainer_ranks,
            f"trainer_ranks={init_info.trainer_ranks} but the trainer's layout has "
            f"{src.world_size} ranks",
        )
        pc = self.parallel_config
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        # this worker's rank in the deployment's layout: pp-major, tp fastest
        local = get_pp_group().rank_in_group * tp + get_tp_group().rank_in_group
        n_src = init_info.trainer_ranks
        targets = Targets(spec=spec, src=src, trainer_ranks=n_src, tp=tp, pp=pp, local=local)
        targets.plan(default_mode(spec))  # the pure planning fails here, before any group
        apply = init_info.apply
        in_place = (apply == "in_place") or (apply == "auto" and self.device.type != "cpu")
        if init_info.check_only:
            return
        self.shutdown()
        store = open_store(
            init_info.store_host,
            init_info.store_port,
            is_master=False,
            timeout_s=init_info.connect_timeout_s,
        )
        group = SyncGroup.from_store(
            store,
            members=range(n_src + tp * pp),
            rank=targets.rank,
            timeout_s=float(init_info.timeout_s),
            connect_timeout_s=float(init_info.connect_timeout_s),
            name=init_info.group,
        )
        if local == 0:
            facts = {
                "tp": tp,
                "pp": pp,
                "dtype": str(self.model_config.dtype).removeprefix("torch."),
                "model": str(self.model_config.model),
                "device": self.device.type,
                "apply": "in_place" if in_place else "reload",
                "modes": list(modes(spec)),
                "version": self.version,
            }
            group.post_signed("deployment", json.dumps(facts))
        self._group, self._targets, self._in_place = group, targets, in_place

    def start_weight_update(self) -> None:
        pass  # nothing to prepare: the model changes only after a committed sync

    def receive_weights(self, update_info: ArealFnUpdateInfo) -> None:
        group = self._group
        _check(
            group is not None and not group.broken,
            "no trainer is connected (the last update failed, or none connected): "
            "call /init_weight_transfer_engine again",
        )
        assert group is not None
        if self.version is not None and update_info.version <= self.version:
            reason = (
                f"vLLM rank {group.rank} holds version {self.version}; version "
                f"{update_info.version} is not newer, refused (versions must increase)"
            )
            _fail(group, group.syncs, reason)  # the trainer's ranks fail at once
            raise ValueError(f"areal_fn weight transfer: {reason}")
        t0 = time.perf_counter()
        wire = None if update_info.wire_dtype is None else _DTYPES[update_info.wire_dtype]
        mode = update_info.mode
        _check(
            mode in modes(self._targets.spec),
            f"mode={mode!r} is not one this model supports: {list(modes(self._targets.spec))}",
        )
        plan, shapes = self._targets.plan(mode)
        buckets = bucket(plan, update_info.bucket_bytes, version=update_info.version)
        dtype: Any = self.model_config.dtype
        in_place = self._in_place and mode == "sharded"
        if in_place:
            dst = live_tensors(self.model, list(shapes))
        else:
            dst = {n: torch.zeros(s, dtype=dtype, device=self.device) for n, s in shapes.items()}
        report = send_and_receive(
            buckets, src_tensors={}, dst_tensors=dst, group=group, wire_dtype=wire
        )
        if mode == "full":
            apply_full(self.model, dst, self.model_config)
        elif not in_place:
            apply_reload(self.model, dst, self.model_config)
        self.version = update_info.version
        self.last_report = report
        self.last_seconds = time.perf_counter() - t0

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.abort()
        self._group = None


def _calling_worker(engine: object) -> Any:
    """The vLLM worker whose method called ``engine`` (the object on the call stack
    holding it as ``weight_transfer_engine``), or None."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not engine and getattr(owner, "weight_transfer_engine", None) is engine:
            return owner
        frame = frame.f_back
    return None
