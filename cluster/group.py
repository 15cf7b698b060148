"""The click group every Rallypoint command line uses: errors as one clear line."""

from __future__ import annotations

import sys
from typing import Any

import click

from rallypoint.basics.errors import RallypointError


class RallypointGroup(click.Group):
    """A command group that turns every RallypointError into one clear line and exit status 1
    (the daemons' commands, and the ``rallypoint`` command's: ``rallypoint.client.commands.main``)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except RallypointError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
