"""Offload to CPU, disk, peers and remote stores: the scheduler-side planner and the per-rank copier
(worker side)."""
