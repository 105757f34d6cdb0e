"""Fingerprinter: learns how each task grows its memory and predicts its peak."""
