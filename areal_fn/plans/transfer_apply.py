"""Apply a transfer plan to tensors held in one process (no communication).

The reference semantics of a plan: the runtime executor must give the same result.
Used by the laws (simulated ranks) and by colocated local copies.
"""

from collections.abc import Iterable, Mapping, MutableMapping

from torch import Tensor

from areal_fn.errors import PlanError
from areal_fn.plans.transfer import Transfer


def apply_transfers(
    transfers: Iterable[Transfer],
    src_tensors: Mapping[int, Mapping[str, Tensor]],
    dst_tensors: MutableMapping[int, MutableMapping[str, Tensor]],
) -> int:
    """Copy every transfer's source box into its destination box; returns bytes copied."""
    total = 0
    for t in transfers:
        try:
            s = src_tensors[t.src][t.src_tensor]
            d = dst_tensors[t.dst][t.dst_tensor]
        except KeyError as e:
            raise PlanError(
                f"transfer {t} names a tensor or rank that is not present: {e}"
            ) from None
        region = d[t.dst_box.slices()]
        region.copy_(s[t.src_box.slices()].reshape(region.shape))
        total += t.nbytes
    return total
