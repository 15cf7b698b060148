"""structlog set-up: JSON events, one per line, with stable names and bound fields.

Event names are dotted and stable (``worker.registered``, ``worker.lost``,
``lease.revoked``, ``leader.elected``); context such as cluster, worker and
incarnation is bound with :func:`bind` rather than formatted into prose.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import structlog

_configured = False

# The libraries whose own logging is theirs, not the user's: Orbax logs through absl (a warning for each
# step folder it reads that has no metadata file), JAX and its runtime through their module loggers.
LIBRARY_LOGGERS = ("absl", "orbax", "jax", "jaxlib", "tensorstore")


def configure(stream: IO[str] | None = None, level: str | None = None) -> None:
    """Send JSON log events to ``stream`` (default stderr), one per line.

    ``level`` defaults to ``RALLYPOINT_LOG_LEVEL`` or ``info``.
    """
    global _configured
    level_name = (level or os.environ.get("RALLYPOINT_LOG_LEVEL", "info")).upper()
    numeric = logging.getLevelName(level_name)
    if not isinstance(numeric, int):
        numeric = logging.INFO
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str, **fields: Any) -> Any:
    """A structlog logger with ``fields`` bound to every event."""
    if not _configured:
        configure()
    return structlog.get_logger(name).bind(**fields)


class _LazyFileHandler(logging.FileHandler):
    """A file handler that creates the file, and its folder, on the first record only."""

    def _open(self) -> Any:
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


@contextlib.contextmanager
def library_logs_to(path: Path) -> Iterator[Path]:
    """While the block runs, the libraries' logging (:data:`LIBRARY_LOGGERS`) goes to ``path``, not the terminal.

    A command that reads checkpoints in its own process (the chaos runner's invariants restore every commit)
    would otherwise print a page of Orbax's absl warnings between its own lines. The records keep their
    level threshold (the root logger's); the file is created on the first one, so a quiet run leaves none.
    Rallypoint's own events (structlog) and Python warnings still reach stderr.
    """
    handler = _LazyFileHandler(path, delay=True, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved: list[tuple[logging.Logger, bool]] = []
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate))
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield Path(path)
    finally:
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate
        handler.close()
