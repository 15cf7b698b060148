"""The suite's own shape: a test module imports shared helpers from tests/fakes.py, tests/examples.py,
tests/helpers/ or a conftest.py, never from another test module (a test module's helpers moved or renamed
would break modules that only borrowed them, and importing one runs its module-level set-up twice over)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

def _package(path: Path) -> list[str]:
    return ["tests", *path.parent.relative_to(TESTS).parts]


def imported_modules(path: Path, text: str | None = None) -> set[str]:
    """The dotted names of the modules ``path`` (its ``text``) imports, anywhere in it (functions' imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's own package up
                package = _package(path)
                package = package[:len(package) - node.level + 1]
                base = ".".join([*package, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from tests.x import test_y`
    return found


def test_no_test_module_imports_another_test_module() -> None:
    borrowed = sorted(
        (str(path.relative_to(TESTS.parent)), module)
        for path in TESTS.rglob("*.py")
        for module in imported_modules(path)
        if module.split(".")[0] == "tests" and module.rsplit(".", 1)[-1].startswith("test_")
    )
    assert borrowed == [], \
        "move the shared helper to tests/helpers/, tests/fakes.py or a conftest.py and import it from there"


def test_the_check_sees_every_form_of_import() -> None:
    text = ("from tests.orchestrator.test_executor import Harness\n"
            "from tests.orchestrator import test_runs\n"
            "from .test_job_progress import run\n"
            "from tests.helpers.executor import pipeline_spec\n"
            "def f():\n    import tests.workers.test_runtime\n")
    found = {m for m in imported_modules(TESTS / "orchestrator" / "test_probe.py", text)
             if m.rsplit(".", 1)[-1].startswith("test_")}
    assert found == {"tests.orchestrator.test_executor", "tests.orchestrator.test_runs",
                     "tests.orchestrator.test_job_progress", "tests.workers.test_runtime"}
