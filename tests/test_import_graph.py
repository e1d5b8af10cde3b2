"""The packages' import graph, read from the source (every import statement, also those inside
functions): no cycles among the kernels' modules."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def imports(*packages: str) -> dict[str, set[str]]:
  """module -> the modules of `packages` it imports (`from a.b import c` counts a.b.c where
  that is a module, else a.b)."""
  files = {}
  for package in packages:
    for dirpath, _, names in os.walk(os.path.join(ROOT, package)):
      for name in names:
        if name.endswith(".py"):
          files[_module(os.path.join(dirpath, name))] = os.path.join(dirpath, name)
  graph = {}
  for mod, path in files.items():
    deps = set()
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        for alias in node.names:
          full = f"{node.module}.{alias.name}"
          deps.add(full if full in files else node.module)
      elif isinstance(node, ast.Import):
        deps.update(a.name for a in node.names)
    graph[mod] = {d for d in deps if d in files and d != mod}
  return graph


def _cycle(graph):
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for d in sorted(graph.get(m, ())):
      if state.get(d) == "open":
        return stack[stack.index(d):] + [d]
      if d not in state and (found := visit(d)):
        return found
    state[m] = "done"
    stack.pop()
    return None

  for m in sorted(graph):
    if m not in state and (found := visit(m)):
      return found
  return None


def test_no_import_cycles_among_the_kernels():
  graph = imports("pallas_kernels")
  assert "pallas_kernels.fp4_matmul.api" in graph["pallas_kernels.fp4_matmul"]  # it reads them
  assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_model_imports_no_kernel():
  """Kernel choice is injected (an ops object, `pallas_kernels.dispatch`): the model package
  reads none of pallas_kernels."""
  graph = imports("trace_jax", "pallas_kernels")
  assert "pallas_kernels.dispatch" in graph["trace_jax.rl.rollout"]  # the engine picks one
  for mod, deps in graph.items():
    if mod.startswith("trace_jax.models"):
      assert not any(d.startswith("pallas_kernels") for d in deps), (mod, deps)
