"""Sequence parallelism: one packed sequence split over the ranks of a process group (Ulysses, ring, hybrid)."""

from zoo.parallel.sequence import SequenceParallel, SequenceParallelAttention, ShardPlan, balanced_layout

__all__ = ["SequenceParallel", "SequenceParallelAttention", "ShardPlan", "balanced_layout"]
