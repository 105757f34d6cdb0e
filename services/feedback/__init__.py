"""Feedback: records the outcome of every action and serves uncertainty-weighted statistics."""
