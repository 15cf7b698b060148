"""The generated reference pages (docs/reference/cli.md, jobspec.md) are what the code generates now."""

from __future__ import annotations

import difflib

import pytest

from rallypoint import gen_reference
from tests.docs.markdown import ROOT


@pytest.mark.parametrize("name", sorted(gen_reference.pages()))
def test_the_committed_reference_page_is_what_the_code_generates(name: str) -> None:
    committed = ROOT / "docs" / "reference" / name
    generated = gen_reference.pages()[name]
    have = committed.read_text() if committed.exists() else ""
    if have != generated:
        diff = "".join(list(difflib.unified_diff(have.splitlines(True), generated.splitlines(True),
                                                 f"committed {name}", f"generated {name}"))[:40])
        pytest.fail(f"docs/reference/{name} is stale: run `{gen_reference.REGENERATE}` from the repository's root "
                    f"and commit the result.\n{diff}")


def test_the_cli_page_lists_every_command_and_option_of_rallypoint() -> None:
    import click

    from rallypoint.cli import main

    page = gen_reference.cli_reference()

    def walk(group: click.Group, path: list[str]) -> None:
        for name in group.list_commands(click.Context(group)):
            command = group.get_command(click.Context(group), name)
            assert command is not None
            assert f"`{' '.join([*path, name])}`" in page
            for option in command.params:
                if isinstance(option, click.Option) and not option.hidden:
                    assert all(f"`{o}`" in page for o in option.opts)
            if isinstance(command, click.Group):
                walk(command, [*path, name])

    walk(main, ["rallypoint"])
    assert "`--fail`" in page and "`ACTION:NAME@STEP`" in page


def test_the_jobspec_page_has_every_field_of_jobspec_with_its_comment() -> None:
    from rallypoint.proto import rallypoint_pb2 as pb

    page = gen_reference.jobspec_reference()
    for field in pb.JobSpec.DESCRIPTOR.fields:
        assert f"| `{field.name}` | {field.number} |" in page
    assert "| `window` | 4 | int32 | steps in flight (0: the leader decides, from checkpoint_every and log_limit_bytes) |" in page
    assert "## CodeBundle" in page and "## GangMember" in page and "### InputBinding.Kind" in page


def test_the_proto_parser_joins_a_fields_comment_lines_and_reads_nested_enums() -> None:
    blocks = gen_reference.parse_proto(
        "// A message.\nmessage M {\n  enum K {\n    A = 0;  // first\n  }\n  // above\n  // more\n"
        "  repeated int32 x = 1;  // beside\n\n  optional string y = 2;\n  map<string, int32> z = 3;\n}\n")
    m = blocks["M"]
    assert m.comment == "A message."
    assert m.members["x"].comment == "above more beside"
    assert m.members["y"].comment == "" and "z" in m.members
    assert m.nested["K"].members["A"].comment == "first"
