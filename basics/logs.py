"""structlog set-up: JSON events, one per line, with stable names and bound fields.

Event names are dotted and stable (``worker.registered``, ``worker.lost``,
``lease.revoked``, ``leader.elected``); context such as cluster, worker and
incarnation is bound with :func:`bind` rather than formatted into prose.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO, Any

import structlog

_configured = False


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
