"""Fleetpilot's services: one thin adapter per folder, each its own process and container."""
