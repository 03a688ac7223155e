"""Parallelism over zoo models: `parallelize` (sequence parallel, activation checkpointing, compile, FSDP2 in that
order) and sequence parallelism (one packed sequence split over a group: Ulysses, ring, hybrid)."""

from zoo.parallel.fsdp import parallelize
from zoo.parallel.sequence import SequenceParallel, SequenceParallelAttention, ShardPlan, balanced_layout

__all__ = ["SequenceParallel", "SequenceParallelAttention", "ShardPlan", "balanced_layout", "parallelize"]
