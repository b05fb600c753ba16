"""Cluster simulator: the serving request flow and the engine's host core
(scheduler, allocators, rank choice) over simulated workers, with roofline
or calibrated step costs."""
