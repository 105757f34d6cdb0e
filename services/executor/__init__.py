"""Executor: carries out decisions on a backend, exactly once, and reports every action."""
