"""vLLM plugin: registers the ``areal_fn`` weight-transfer backend in every vLLM process.

Installed as the entry point ``areal_fn = areal_fn.runtime.vllm.plugin:register`` of
the group ``vllm.general_plugins`` (``pyproject.toml``), which vLLM loads in its
front end, its engine core and every worker. The backend module is imported only
when vLLM creates the engine (``weight_transfer_config={"backend": "areal_fn"}``).
"""

__all__ = ["register"]


def register() -> None:
    """Register the backend with vLLM's weight-transfer registry (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from areal_fn.runtime.vllm.backend_name import AREAL_FN_BACKEND

    if AREAL_FN_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            AREAL_FN_BACKEND, "areal_fn.runtime.vllm.backend", "ArealFnWeightTransferEngine"
        )
