"""The etcd layer, the bottom of Rallypoint: every other layer stands on it.

The store and its key schema, etcd leases and the fences built on them, the clock,
the error hierarchy, structured logs, checkpoint commits and the etcd server that
tests and the embedded cluster run. It imports nothing of Rallypoint above it.
"""
