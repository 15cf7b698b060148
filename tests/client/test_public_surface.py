"""The client's public surface: every name a job file imports comes from ``rallypoint.client``, documented."""

from __future__ import annotations

import importlib

import rallypoint.client as client


def test_every_public_name_resolves_to_its_home() -> None:
    for name in client.__all__:
        home = importlib.import_module(f"rallypoint.client.{client._HOME_OF[name]}")
        assert getattr(client, name) is getattr(home, name), name
    assert {"Program", "gather", "compile_program", "submit", "watch", "GrainBatches"} <= set(client.__all__)


def test_every_public_name_is_documented_in_the_package() -> None:
    doc = client.__doc__ or ""
    missing = [name for name in client.__all__ if name not in doc]
    assert missing == []


def test_an_unknown_name_names_itself() -> None:
    try:
        client.Programme  # noqa: B018
    except AttributeError as exc:
        assert "Programme" in str(exc)
    else:
        raise AssertionError("rallypoint.client.Programme resolved")


def test_the_program_api_page_lists_every_public_name() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "program-api.md").read_text()
    missing = [name for name in client.__all__ if f"`{name}`" not in page]
    assert missing == []
