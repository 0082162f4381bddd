"""Serving: the batching engine and the OpenAI-compatible HTTP server (``sharktank serve``)."""
