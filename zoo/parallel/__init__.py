"""Parallelism over zoo models: `parallelize` (sequence parallel, activation checkpointing, compile, FSDP2 in that
order) and sequence parallelism (one packed sequence split over a group: Ulysses, ring, hybrid; a rank's part of
the pack is a `Shard`)."""

from zoo.parallel.fsdp import parallelize
from zoo.parallel.sequence import SequenceParallel, SequenceParallelAttention
from zoo.parallel.shard import Shard, ShardPlan, balanced_layout

__all__ = ["SequenceParallel", "SequenceParallelAttention", "Shard", "ShardPlan", "balanced_layout", "parallelize"]
