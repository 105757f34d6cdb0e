"""Fleetpilot: a decision engine for heterogeneous GPU fleets.

The library is split by domain: ``contracts`` (the wire language), ``runtime`` (the bus and
service host), ``fleet`` (resource model, simulator, topology), ``policy``, ``fingerprint``,
``sla``, ``feedback``, ``maintenance``, ``bench`` and the ``cli``.
"""

__version__ = "0.1.0"
