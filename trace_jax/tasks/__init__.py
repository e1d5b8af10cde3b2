"""Task families: a task gives prompts, reference completions and rewards (see base.Task)."""

from trace_jax.tasks.base import Task, Turn
from trace_jax.tasks.reasoning import ReasoningTask

__all__ = ["ReasoningTask", "Task", "Turn"]
