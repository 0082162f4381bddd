"""Parallelism plans and placement directives."""

from .directives import load_directives, plan_from_directives
from .plan import ParallelPlan, PlanError, contiguous_blocks

__all__ = ["ParallelPlan", "PlanError", "contiguous_blocks", "load_directives", "plan_from_directives"]
