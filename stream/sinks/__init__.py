"""Sinks: where detections go. The ZeroMQ XPUB publisher (publish), the proxy in front of several workers
(proxy), CURVE keys (curve), annotated video (annotate, drawing).
"""
