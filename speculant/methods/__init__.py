"""Drafting methods, one per file: each proposes tokens that the target then verifies."""
