"""The bus runtime: typed handlers over NATS (or in memory), with dead letters, retries,
trace context, metrics and graceful shutdown handled once for every service."""

from .bus import Bus, CasConflict, Delivery, KeyValue, KvEntry, Reject, Retry, subject_matches
from .config import BadSettings, ServiceSettings
from .dispatch import Dispatcher
from .host import ServiceHost, serve
from .memory import InMemoryBus
from .partition import Partition, partition_of

__all__ = ["BadSettings", "Bus", "CasConflict", "Delivery", "Dispatcher", "InMemoryBus", "KeyValue", "KvEntry", "Partition",
           "Reject", "Retry", "ServiceHost", "ServiceSettings", "partition_of", "serve", "subject_matches"]
