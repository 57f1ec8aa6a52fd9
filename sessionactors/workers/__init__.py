"""The multi-worker layer: sessions reached on whichever worker runs them.

A plug-in behind the core's router seam. A store that connects workers opens
it for each registry (``RedisStore.open_router``); a custom store offers a
:class:`Transport` and calls :func:`open_cluster` the same way.
"""

from ._cluster import Cluster as Cluster
from ._cluster import ClusterStatistics as ClusterStatistics
from ._cluster import open_cluster as open_cluster
from ._transport import StreamItem as StreamItem
from ._transport import Transport as Transport

__all__ = ["Cluster", "ClusterStatistics", "StreamItem", "Transport", "open_cluster"]
