"""Capture: a single-device model traced by dynamo and AOTAutograd into one joint ``ir.Graph``."""
