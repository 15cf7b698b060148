"""Each fact of a running job has one mover (orchestrator/job/__init__.py has the table): a scan of the source.

Cheap and coarse: it reads the orchestrator's modules with :mod:`ast` and fails when

* a module other than the store reaches into the store's fields (``x._cut``, ``x._holds``, ...
  on anything but ``self``), or keeps a field of its own under a fact's name (``self.holds``);
* a module other than the executor (and its :class:`~rallypoint.orchestrator.job.cut.JobCut`,
  for the cut, the commits and the log floor) calls (or hands out) a mover of the progress or
  of the grants (``progress.restored``, ``progress.floor``, ``grants.hold``, ...), or drops a
  commit in etcd (``term.drop_commit``): the others return
  a decision (a :class:`~rallypoint.orchestrator.job.grants.Hold`, a
  :class:`~rallypoint.orchestrator.job.progress.LogFloor`, a
  :class:`~rallypoint.orchestrator.job.metrics.NonFiniteStop`, a restore point) that the
  executor carries out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "orchestrator"

# The store of each fact, and the private fields that hold it there.
STORES = {
    "job/progress.py": {"_completed", "_start", "_cut", "_committed", "_saved", "_floor"},
    "job/grants.py": {"_granted", "_halted", "_holds", "_refused"},
}
# A fact's name that no other module keeps a field under (a second store of it).
FACT_NAMES = {"_cut", "cut", "_floor", "log_floor", "_holds", "holds", "_halted", "halted", "_refused",
              "_ungranted", "_committed", "_saved"}
# The movers, reached through an object named ``progress`` or ``grants``: the executor alone uses them.
MOVERS = {
    "progress": {"begin", "instance", "complete", "widen", "halt", "commit", "drop_commit", "restored", "floor",
                 "reset_floor", "rewind"},
    "grants": {"begin", "widen", "halt", "hold", "refused", "retry"},
    "term": {"drop_commit"},  # a commit dropped in etcd: the executor's _drop_commit, with the progress
}
# The executor: its loop (executor.py) and the modules its event handling, its losses and its rollbacks (a whole
# job back to an older cut) were split into.
EXECUTOR = ("job/executor.py", "job/events.py", "job/losses.py", "job/rollback.py")
CUT_MOVER = "job/cut.py"  # the executor's JobCut: the cut, the commits and the log floor others decided


def _modules() -> dict[str, ast.Module]:
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(), str(p)) for p in sorted(ROOT.rglob("*.py"))}


def _owner_name(node: ast.expr) -> str:
    """``progress`` for ``progress``, ``self.progress`` and ``self.x.progress``; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def test_no_module_but_the_store_reaches_into_a_facts_fields_or_keeps_its_own_copy() -> None:
    private = {f: path for path, fields in STORES.items() for f in fields}
    bad = []
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private and private[node.attr] != path:
                if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                    bad.append(f"{path}:{node.lineno} reads {node.attr} of another object")
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                        and t.attr in FACT_NAMES and path not in STORES):
                    bad.append(f"{path}:{t.lineno} keeps a field named {t.attr}")
    assert bad == [], bad


def test_only_the_executor_moves_the_progress_and_the_grants() -> None:
    bad = []
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            owner = _owner_name(node.value)
            if node.attr not in MOVERS.get(owner, ()):
                continue
            if path in EXECUTOR or (path == "job/progress.py" and owner == "grants") or (
                    path == CUT_MOVER and owner in ("progress", "term")):
                continue
            bad.append(f"{path}:{node.lineno} uses {owner}.{node.attr}")
    assert bad == [], bad


def test_the_scan_sees_a_second_mover() -> None:
    """The scan itself: a drain that moved the floor, or kept holds, would be found."""
    tree = ast.parse("class D:\n    def move(self):\n        self.progress.floor(['n'], 3)\n        self.holds = {}\n")
    movers = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)
              and n.attr in MOVERS.get(_owner_name(n.value), ())]
    fields = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Attribute) and t.attr in FACT_NAMES for t in n.targets)]
    assert len(movers) == 1 and len(fields) == 1
