"""Every command line the documentation shows parses with the real command line, without running it.

Each ``rallypoint ...`` line (and each ``python -m rallypoint.cluster.daemons ...`` line) of a code block in
README.md, CONTRIBUTING.md and docs/ is parsed by click as the shell would hand it over: placeholders (JOB, NAME,
HOST:PORT, WORKER, DIR, N, ...) become sample values, and a synopsis's optional parts (``[--json]``,
``[--state-dir DIR | --cluster ...]``) and alternatives (``cordon|uncordon``, ``partial|restart-all``) are tried
left out, each alone, and all together. An unknown command or option, a missing argument or required option, a
bad choice or number, and ``--cluster`` without ``--tls-dir`` or ``--insecure`` (which the CLI refuses before it
connects: client/commands/clusters.py ``client_tls``, cluster/daemons.py ``tls_from_options``) fail the test with
the file and line. docs/reference/cli.md is left out: it is generated from the same definitions.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator

import click
import pytest

from tests.docs.markdown import ROOT, command_lines, doc_files

SAMPLE_DIR = ROOT / "examples"  # an existing folder, for options that want one to exist

# Placeholders, longest first: what a reader types in their place.
PLACEHOLDERS = [
    (r"\[NAME@\]HOST:PORT\[,\.\.\.\]", "local@127.0.0.1:2379"),
    (r"NAME@HOST:PORT\[,\.\.\.\]", "local@127.0.0.1:2379"),
    (r"NAME@HOST:PORT\[,HOST:PORT\.\.\.\]", "local@127.0.0.1:2379"),
    (r"NAME@ENDPOINTS", "local@127.0.0.1:2379"),
    (r"HOST:PORT\[,\.\.\.\]", "127.0.0.1:2379"),
    (r"HOST:PORT", "127.0.0.1:2379"),
    (r"\bJOB_FILE\b|\bJOB\.py\b", "examples/pipeline_mlp.py"),
    (r"\bSCENARIO(?:_FILE)?\.toml\b|\bSCENARIO_FILE\b", "scenarios/kill-worker.toml"),
    (r"\bJOB\b|\bNAME\b", "pipeline-mlp"),
    (r"\bWORKER\b|\bID\b", "w1"),
    (r"\bRUN\b", "r1"),
    (r"\bDIR\b|\bROOT\b", str(SAMPLE_DIR)),
    (r"\bPATH\b", "out.png"),
    (r"%H", "gpu-host-7"),
    (r"(?<=\s)(?:N|M|K|C|S|T|W)(?=\s|\]|$)", "2"),
    (r"(?<=--platform )P\b", "cpu"),
]

# What each tool is: the `rallypoint` entry point, and the daemons a service manager starts.
def programs() -> dict[str, click.Group]:
    from rallypoint.cli import main
    from rallypoint.cluster.daemons import main as daemons

    return {"rallypoint": main, "daemons": daemons}


# -- a synopsis's variants -----------------------------------------------------------------------------------


def _groups(text: str) -> list[str | list[str]]:
    """``text`` split into plain text and optional groups ``[...]`` (each a list of its alternatives, split at
    `` | ``; a nested group stays inside its alternative's text)."""
    out: list[str | list[str]] = []
    depth, start, plain = 0, 0, ""
    for i, ch in enumerate(text):
        if ch == "[":
            if depth == 0:
                out.append(plain)
                plain, start = "", i + 1
            depth += 1
        elif ch == "]" and depth:
            depth -= 1
            if depth == 0:
                out.append([a.strip() for a in re.split(r"\s\|\s", text[start:i])])
        elif depth == 0:
            plain += ch
    out.append(plain)
    return out


def variants(text: str) -> list[str]:
    """The command lines a synopsis stands for: optional groups all left out, each alternative of each group alone,
    every group with its first alternative; a word ``a|b`` as ``a`` and as ``b``. A group of ``...`` only (``[...]``,
    ``[--fail ...]``) is left out."""
    parts = _groups(text)
    optional = [i for i, p in enumerate(parts) if isinstance(p, list) and not any("..." in a for a in p)]

    def build(chosen: dict[int, str]) -> str:
        return " ".join(p if isinstance(p, str) else chosen.get(i, "") for i, p in enumerate(parts))

    lines = [build({})]
    for i in optional:
        alternatives = parts[i]
        assert isinstance(alternatives, list)
        lines += [build({i: a}) for a in alternatives]
    lines.append(build({i: parts[i][0] for i in optional}))  # type: ignore[index]
    out: list[str] = []
    for line in dict.fromkeys(" ".join(line.split()) for line in lines):
        nested = [v for v in variants(line)] if "[" in line else [line]
        for v in nested:
            words = v.split()
            choice = next((k for k, w in enumerate(words) if "|" in w and not w.startswith(("'", '"'))), None)
            if choice is None:
                out.append(v)
            else:
                out += [" ".join([*words[:choice], alt, *words[choice + 1:]]) for alt in words[choice].split("|")]
    return list(dict.fromkeys(out))


def substitute(text: str) -> str:
    for pattern, value in PLACEHOLDERS:
        text = re.sub(pattern, value, text)
    return text


# -- parsing with the real CLI -------------------------------------------------------------------------------


def parse(program: str, args: list[str]) -> None:
    """Parse ``args`` as ``program`` would, down to the command's context, running no command. Raises
    click.UsageError (or click.BadParameter) for what the CLI would refuse at parsing, and for --cluster without
    an identity, which it refuses before connecting."""
    group: click.Command = programs()[program]
    ctx = click.Context(group, info_name=program)
    path = [program]
    while isinstance(group, click.Group):
        if not args or args[0].startswith("-"):
            raise click.UsageError(f"missing command after {' '.join(path)}", ctx)
        name, args = args[0], args[1:]
        sub = group.get_command(ctx, name)
        if sub is None:
            raise click.UsageError(f"no such command {' '.join([*path, name])!r}", ctx)
        path.append(name)
        group = sub
        ctx = click.Context(group, info_name=name, parent=ctx)
    sub_ctx = group.make_context(name, list(args), parent=ctx.parent, resilient_parsing=False)  # click eats its list
    params = sub_ctx.params
    tls_dir = params.get("tls_dir") or sub_ctx.meta.get("rallypoint.tls_dir")
    insecure = params.get("insecure") or sub_ctx.meta.get("rallypoint.insecure")
    if params.get("cluster") and "--cluster" in args and not (tls_dir or insecure):
        raise click.UsageError("--cluster needs --tls-dir DIR (or --insecure for a cluster started with it)")
    if tls_dir and insecure:
        raise click.UsageError("--tls-dir and --insecure exclude each other")


def documented_commands() -> Iterator[tuple[str, str, str]]:
    for path in doc_files():
        if path == ROOT / "docs" / "reference" / "cli.md":
            continue
        for n, program, text in command_lines(path):
            yield f"{path.relative_to(ROOT)}:{n}", program, text


def check_line(program: str, text: str) -> list[str]:
    """Every variant of a documented line that the CLI refuses, with click's message."""
    refused = []
    for variant in variants(substitute(text)):
        args = shlex.split(variant, comments=True)
        try:
            parse(program, args)
        except click.exceptions.Exit:
            pass  # --help, --version: the CLI answers and exits 0
        except click.ClickException as exc:
            refused.append(f"{program} {variant!r}: {exc.format_message()}")
    return refused


@pytest.fixture(autouse=True)
def _no_identity_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RALLYPOINT_TLS_DIR", raising=False)  # a reader's shell has none set


COMMANDS = list(documented_commands())


def test_the_documentation_shows_command_lines_of_both_programs() -> None:
    """The extraction finds what it must (a silent regex would pass every file)."""
    where = {w.split(":")[0] for w, _, _ in COMMANDS}
    assert {"README.md", "CONTRIBUTING.md", "docs/operations.md", "docs/guides/run-on-gpu-hosts.md"} <= where
    assert sum(program == "daemons" for _, program, _ in COMMANDS) >= 3
    assert ("README.md", "run examples/pipeline_mlp.py --fail kill:stage2@12") in {
        (w.split(":")[0], " ".join(shlex.split(text, comments=True))) for w, _, text in COMMANDS}


@pytest.mark.parametrize(("where", "program", "text"), COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_a_documented_command_line_parses(where: str, program: str, text: str) -> None:
    assert check_line(program, text) == [], where


@pytest.mark.parametrize(("program", "text", "why"), [
    ("rallypoint", "run examples/pipeline_mlp.py --no-such-option", "No such option"),
    ("rallypoint", "run", "Missing argument"),
    ("rallypoint", "runn examples/pipeline_mlp.py", "no such command"),
    ("rallypoint", "run examples/pipeline_mlp.py --policy sometimes", "Invalid value"),
    ("rallypoint", "up --workers two", "Invalid value"),
    ("rallypoint", "certs", "Missing option"),
    ("rallypoint", "run examples/pipeline_mlp.py --cluster local@HOST:PORT", "--cluster needs --tls-dir"),
    ("rallypoint", "watch NAME --cluster local@HOST:PORT", "--cluster needs --tls-dir"),
    ("rallypoint", "workers --cluster HOST:PORT --tls-dir DIR --insecure", "exclude each other"),
    ("rallypoint", "chaos", "missing command"),
    ("daemons", "worker --cluster prod@HOST:PORT --id w1 --devices 8", "--cluster needs --tls-dir"),
    ("daemons", "worker --id w1 --tls-dir DIR", "Missing option"),
])
def test_a_wrong_command_line_is_refused(program: str, text: str, why: str) -> None:
    refused = check_line(program, text)
    assert refused and all(why in r for r in refused), refused


def test_a_synopsis_stands_for_its_variants() -> None:
    assert variants("workers [--json] [--state-dir D | --cluster C]") == [
        "workers", "workers --json", "workers --state-dir D", "workers --cluster C", "workers --json --state-dir D"]
    assert variants("cordon|uncordon w1 [...]") == ["cordon w1", "uncordon w1"]
    assert variants("run J --fail kill:a@1 [--fail ...] [--policy partial|restart-all]") == [
        "run J --fail kill:a@1", "run J --fail kill:a@1 --policy partial", "run J --fail kill:a@1 --policy restart-all"]
    assert substitute("run JOB.py --cluster NAME@HOST:PORT[,...]") == (
        "run examples/pipeline_mlp.py --cluster local@127.0.0.1:2379")


def test_the_quick_start_fits_in_15_lines_and_runs_the_pipeline_with_a_kill() -> None:
    """The quick start stays short, and the suite runs its `rallypoint run` as written (with --json added to read
    its events): tests/integration/test_recovery.py::test_the_readme_quick_start_recovers_from_its_kill."""
    from tests.docs.markdown import QUICK_START, quick_start_run, section

    lines = [line for line in section(ROOT / "README.md", QUICK_START) if line.strip()]
    assert len(lines) <= 15, f"README.md's quick start has {len(lines)} lines; keep it to 15"
    assert any(line.startswith("make demo") for line in lines) and any(line.startswith("make test") for line in lines)
    assert quick_start_run() == ["run", "examples/pipeline_mlp.py", "--fail", "kill:stage2@12"]
