"""Task families: a task gives prompts, reference completions and rewards (see base.Task)."""

from trace_jax.tasks.base import Task, Turn
from trace_jax.tasks.coding import FunctionSynthesisTask
from trace_jax.tasks.long_horizon import RunningSumTask
from trace_jax.tasks.reasoning import ReasoningTask

__all__ = ["FunctionSynthesisTask", "ReasoningTask", "RunningSumTask", "Task", "Turn"]
