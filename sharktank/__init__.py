"""sharktank: shard inference models across devices and run them with IREE."""

__version__ = "0.1.0"
