"""The ``fleetpilot`` command: run the fleet locally, submit, watch, and the operator tools."""
