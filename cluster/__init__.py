"""Processes: the local cluster launcher and the commands that run the daemons.

Above both the coordinator (``rallypoint.orchestrator``) and the worker
(``rallypoint.workers``), which it starts as processes; below the client.
"""
