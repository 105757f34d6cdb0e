"""Topology: merges node topology reports into the fleet graph and estimates network bandwidth."""
