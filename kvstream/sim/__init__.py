"""A simulated prefix-cache engine: the demo's and the benchmarks' workload."""

from kvstream.sim._check import ConsistencyError, ConsistencyReport, check_consistency
from kvstream.sim._engine import (
    CpuOffloadConnector,
    EngineInput,
    RemoteStoreConnector,
    SimulatedEngine,
)
from kvstream.sim._tiers import block_hash
from kvstream.sim._workload import Request, Workload

__all__ = [
    "ConsistencyError",
    "ConsistencyReport",
    "CpuOffloadConnector",
    "EngineInput",
    "RemoteStoreConnector",
    "Request",
    "SimulatedEngine",
    "Workload",
    "block_hash",
    "check_consistency",
]
