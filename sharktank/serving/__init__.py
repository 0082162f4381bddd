"""Serving compiled models: the batching policy (scheduler.py, over plan.py's step data), the
engine thread that runs it (engine.py), and the HTTP server above it (server.py, with
protocol.py, metrics.py and auth.py)."""
