"""The etcd layer: the store and its key schema, etcd leases and the fences built on them,
checkpoint commits, drain requests, where daemons record their endpoints, and the etcd
server that tests and the embedded cluster run. Below it only :mod:`rallypoint.basics`.
"""
