"""Host-side scheduling (pure Python + numpy, no jax): sequences, the continuous-batching
scheduler and the step plans it hands to the device."""

from jaxllm.sched.buckets import Bucket, BucketLadder
from jaxllm.sched.config import SchedulerConfig
from jaxllm.sched.plan import StepPlan
from jaxllm.sched.scheduler import Scheduler
from jaxllm.sched.sequence import FinishReason, Sequence, SequenceStatus, StopStringCheck

__all__ = [
    "Bucket",
    "BucketLadder",
    "FinishReason",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
    "StepPlan",
    "StopStringCheck",
]
