"""`flexlb simulate`: a discrete-event cluster simulator that drives the real scheduling and engine code."""

from app.sim.cluster import ClusterSim, SimOutcome, mean_cold_prefill_ms
from app.sim.config import SimConfig

__all__ = ["ClusterSim", "SimConfig", "SimOutcome", "mean_cold_prefill_ms"]
