"""The bottom layer: basics every other layer uses, and that import nothing of Rallypoint.

The injected clock (:mod:`~rallypoint.basics.clock`), structured logs
(:mod:`~rallypoint.basics.logs`), the one retry policy (:mod:`~rallypoint.basics.retry`),
the error root and its subclasses (:mod:`~rallypoint.basics.errors`), mutual TLS
(:mod:`~rallypoint.basics.tls`) and the Prometheus endpoint a daemon serves
(:mod:`~rallypoint.basics.metrics_server`).
"""
