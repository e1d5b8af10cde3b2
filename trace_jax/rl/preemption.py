"""Stops at step boundaries: SIGTERM (a preemption) and SIGINT (Ctrl-C) end a run between steps,
so that the checkpoint saved then counts exactly the steps completed."""

from __future__ import annotations

import signal


class Interrupted(Exception):
  """A SIGTERM or SIGINT stopped the run: after the step in flight, its checkpoint saved (the
  first signal), or at once (a second one)."""

  def __init__(self, signum: int, at_once: bool = False):
    super().__init__(signal.Signals(signum).name)
    self.signum, self.at_once = signum, at_once


class StopBetweenSteps:
  """While active, SIGTERM and SIGINT set a flag the loop reads between steps, so a step's
  update, metrics row and checkpoint happen whole or not at all; a second signal stops at once
  (the newest checkpoint and its rows stay as they were)."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signum, self._previous = None, {}

  def _handle(self, signum, frame):
    if self.signum is not None:
      raise Interrupted(signum, at_once=True)
    self.signum = signum

  def __enter__(self):
    self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
