"""Timing for the kernels' benchmarks: device time from profiler traces, the copy bandwidth
that the benchmarks' roofline fractions divide by, and CUDA-event timing of PyTorch's
baselines. Shared by every `bench.py` under pallas_kernels and by experiments/bench_rollout.py.
"""

from __future__ import annotations

import glob
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

KERNELS: dict[str, float] = {}  # per kernel name: microseconds per call, of the last trace


def kernel_times(fn, *args, launches: dict[str, int] | None = None) -> dict[str, float] | None:
  """Microseconds per kernel name (summed over launches) in a profiler trace of one call of
  `fn(*args)` (which has run before: compiled), on the device's streams, copies and memsets
  left out. None where the trace has no GPU plane (CPU). `launches`, if given, gets the number
  of launches of each name."""
  from jax.profiler import ProfileData
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      jax.block_until_ready(fn(*args))
    [path] = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
    plane = ProfileData.from_file(path).find_plane_with_name("/device:GPU:0")
    if plane is None:
      return None
    lines = [l for l in plane.lines if l.name.startswith("Stream")] or list(plane.lines)
    times: dict[str, float] = {}
    for e in (e for l in lines for e in l.events):
      if not e.name.lower().startswith(("memcpy", "memset")):
        times[e.name[:60]] = times.get(e.name[:60], 0.0) + e.duration_ns / 1e3
        if launches is not None:
          launches[e.name[:60]] = launches.get(e.name[:60], 0) + 1
  return times


def device_seconds(fn, *args, calls: int = 1) -> float | None:
  """GPU time of `fn(*args)` from a profiler trace: the summed durations of the kernels it ran on
  the device's streams, over `calls` (the matmuls in one call of fn), without host dispatch or
  launch gaps. None where the trace has no GPU plane (CPU). Leaves the split per kernel name in
  KERNELS."""
  jax.block_until_ready(fn(*args))
  times = kernel_times(fn, *args)
  if times is None:
    return None
  KERNELS.clear()
  KERNELS.update({name: us / calls for name, us in times.items()})
  return sum(KERNELS.values()) / 1e6


def time_calls(matmul, x, weights, reps: int = 7) -> tuple[float, float | None]:
  """(wall, device) seconds per matmul. One jitted call runs the matmul once on each weight copy
  (separate buffers, together larger than the L2 cache; one dispatch) and returns every output.
  Wall: the median over `reps` calls, host dispatch included (it dominates short kernels);
  device: the kernels' own time in a profiler trace of one call (`device_seconds`)."""

  @jax.jit
  def loop(x, ws):
    return tuple(matmul(x, w) for w in ws)

  jax.block_until_ready(loop(x, weights))
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(loop(x, weights))
    samples.append((time.perf_counter() - start) / len(weights))
  return statistics.median(samples), device_seconds(loop, x, weights, calls=len(weights))


def copy_bandwidth(gib: float = 2.0, reps: int = 7) -> float:
  """Bytes read plus written per second by a large device-to-device copy (PyTorch's copy_
  where torch sees the GPU, else an XLA elementwise pass). On a CPU the copy takes at most
  0.25 GiB, still several times a large last-level cache: the benchmarks run there only to check
  themselves, and 2 GiB took ~18 s on 2 cores for the same bandwidth."""
  try:
    import torch
    if torch.cuda.is_available():
      src = torch.randn(int(gib * 2**30) // 4, device="cuda")
      dst = torch.empty_like(src)
      dst.copy_(src)
      torch.cuda.synchronize()
      samples = []
      for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
      return 2 * src.numel() * 4 / statistics.median(samples)
  except ImportError:
    pass
  if jax.default_backend() == "cpu":
    gib = min(gib, 0.25)
  x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)  # any values: a pass over the bytes
  return 2 * x.nbytes / wall_seconds(jax.jit(lambda a: a * 1.0001), x, reps=reps)


def wall_seconds(fn, *args, reps: int = 7) -> float:
  """The median host-clock seconds of `fn(*args)` to its results, after one call (compiled)."""
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - start)
  return statistics.median(samples)


def cuda_event_seconds(torch, call, ws, reps: int = 5) -> float:
  """Median seconds per call(w), by CUDA events around a pass over the weight copies."""
  for w in ws:
    call(w)
  torch.cuda.synchronize()
  samples = []
  for _ in range(reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for w in ws:
      call(w)
    end.record()
    torch.cuda.synchronize()
    samples.append(start.elapsed_time(end) / 1e3 / len(ws))
  return statistics.median(samples)
