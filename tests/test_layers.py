"""The layers of DESIGN.md: imports point down.

client -> orchestrator/recovery -> proto (client/cli.py also mounts the chaos commands, the top
layer); workers -> proto and the etcd layer of
orchestrator only (store, keys, lease, clock, logs, errors), never the
coordinator; nothing below imports client or chaos.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("client", "orchestrator", "workers", "recovery", "chaos", "proto")
ETCD_LAYER = {"orchestrator", "orchestrator.store", "orchestrator.keys", "orchestrator.lease", "orchestrator.clock",
              "orchestrator.logs", "orchestrator.errors", "orchestrator.etcd_server", "orchestrator.commits"}

ALLOWED = {
    "client": set(PACKAGES) - {"chaos"},
    "orchestrator": {"orchestrator", "recovery", "proto"},
    "recovery": {"recovery", "proto", "orchestrator"},
    "workers": {"workers", "proto", "orchestrator"},
    "chaos": set(PACKAGES),
    "proto": {"proto"},
}


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return [m for m in out if m.split(".")[0] in PACKAGES]


def test_imports_point_down() -> None:
    bad = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for mod in imports(path):
                top = mod.split(".")[0]
                if top not in ALLOWED[pkg] and not (path == ROOT / "client" / "cli.py" and mod == "chaos"):
                    bad.append(f"{path.relative_to(ROOT)} imports {mod}")
                elif pkg == "workers" and top == "orchestrator" and mod not in ETCD_LAYER:
                    bad.append(f"{path.relative_to(ROOT)} imports {mod} (workers may use only the etcd layer)")
    assert bad == []


def test_modules_stay_small() -> None:
    big = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for pkg in PACKAGES if pkg != "proto"
        for p in (ROOT / pkg).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    ]
    assert big == []
