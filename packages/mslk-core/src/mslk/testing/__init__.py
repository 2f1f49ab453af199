"""Compatibility paths of the reference library (spec §10); the logic lives in mslk.core."""
