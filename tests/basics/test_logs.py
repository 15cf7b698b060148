"""The libraries' logging goes to a file while a command runs, and back where it was after."""

from __future__ import annotations

import io
import logging
from pathlib import Path

from rallypoint.basics.logs import LIBRARY_LOGGERS, library_logs_to


def test_library_logs_go_to_the_file_not_the_terminal_and_come_back_after(tmp_path: Path) -> None:
    terminal = io.StringIO()
    handler = logging.StreamHandler(terminal)  # as absl.logging's first record installs one on stderr
    logging.root.addHandler(handler)
    try:
        quiet = tmp_path / "quiet.log"
        with library_logs_to(quiet):
            pass
        assert not quiet.exists()  # created on the first record only
        path = tmp_path / "report" / "libraries.log"
        with library_logs_to(path):
            logging.getLogger("absl").warning("Metadata file does not exist: %s", "step 5")
            logging.getLogger("jax._src.xla_bridge").warning("no GPU")
            logging.getLogger("rallypoint.other").warning("the user's")
        logging.getLogger("absl").warning("after")
    finally:
        logging.root.removeHandler(handler)
    assert terminal.getvalue() == "the user's\nafter\n"
    text = path.read_text()
    assert "WARNING absl: Metadata file does not exist: step 5" in text
    assert "WARNING jax._src.xla_bridge: no GPU" in text
    assert "after" not in text and "the user's" not in text
    assert all(logging.getLogger(n).propagate for n in LIBRARY_LOGGERS)
