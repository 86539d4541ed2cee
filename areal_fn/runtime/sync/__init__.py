"""Weight sync: executing bucketed transfer plans over a process group of its own.

``from areal_fn.runtime.sync import SyncGroup, send_and_receive`` (they live in
:mod:`areal_fn.runtime.sync.executor`).
"""

from areal_fn.runtime.sync.executor import SyncError as SyncError
from areal_fn.runtime.sync.executor import SyncGroup as SyncGroup
from areal_fn.runtime.sync.executor import SyncReport as SyncReport
from areal_fn.runtime.sync.executor import Transport as Transport
from areal_fn.runtime.sync.executor import open_store as open_store
from areal_fn.runtime.sync.executor import send_and_receive as send_and_receive
