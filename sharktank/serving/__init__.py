"""Serving compiled models: the continuous-batching engine (engine.py) and the HTTP server above it."""
