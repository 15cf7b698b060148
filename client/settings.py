"""A job file's settings (``rallypoint.client.setting``, ``job_config``): shipped with the job's code bundle.

Defined in :mod:`rallypoint.basics.settings` (a worker's host-source process reads the shipped values
there, below the client layer); docs/data.md, "Job settings".
"""

from rallypoint.basics.settings import job_config, setting

__all__ = ["job_config", "setting"]
