"""Host-side scheduling (pure Python + numpy, no jax): sequences, the continuous-batching
scheduler and the padded batch descriptors it hands to the device."""

from jaxllm.sched.batch import BatchBuilder, BatchDescriptor, BucketLadder, BucketShape
from jaxllm.sched.config import SchedulerConfig
from jaxllm.sched.scheduler import ScheduledBatch, Scheduler
from jaxllm.sched.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus

__all__ = [
    "PLACEHOLDER",
    "BatchBuilder",
    "BatchDescriptor",
    "BucketLadder",
    "BucketShape",
    "FinishReason",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
]
