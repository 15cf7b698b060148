"""The ``rallypoint`` command: the client's commands and the chaos harness's, at the top of the layers."""

from __future__ import annotations

from rallypoint.chaos.cli import chaos
from rallypoint.client.commands.main import main

main.add_command(chaos)

if __name__ == "__main__":
    main()
