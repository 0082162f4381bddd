"""Models built with sharktank.ops (one forward for unsharded, tensor- and pipeline-parallel)."""
