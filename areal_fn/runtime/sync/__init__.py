"""Weight sync: executing bucketed transfer plans over a process group of its own.

``from areal_fn.runtime.sync import SyncGroup, send_and_receive`` (also importable
from :mod:`areal_fn.runtime.sync.executor`). The modules: ``group`` (the group and
its store), ``auth`` (the group's secret, the members' proofs, the MACs of messages,
votes and decisions), ``messages`` (what travels, packed, authenticated and checked),
``progress`` (buckets started, the commit vote), ``delta`` (delta syncs: ``DeltaState``),
``executor`` (``send_and_receive``).
"""

from areal_fn.runtime.sync.delta import DeltaState as DeltaState
from areal_fn.runtime.sync.executor import SyncReport as SyncReport
from areal_fn.runtime.sync.executor import send_and_receive as send_and_receive
from areal_fn.runtime.sync.group import SyncError as SyncError
from areal_fn.runtime.sync.group import SyncGroup as SyncGroup
from areal_fn.runtime.sync.group import Transport as Transport
from areal_fn.runtime.sync.group import open_store as open_store
