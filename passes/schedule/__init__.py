"""Passes that order and group communication: bucketing (``bucket``)."""
