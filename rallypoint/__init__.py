"""Rallypoint: a fault-tolerant training orchestrator for JAX.

The layers, each a subpackage (top to bottom; imports point down):
``cli``, ``chaos``, ``client``, ``cluster``, ``orchestrator`` | ``workers``,
``recovery``, ``proto`` | ``etcd``, ``basics``. The contracts in ``.importlinter`` enforce it.
Users import :mod:`rallypoint.client` (``from rallypoint.client import Program``).
"""

__version__ = "0.1.0"
