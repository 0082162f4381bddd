"""Parallelism plans and placement directives."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .directives import load_directives, plan_from_directives
    from .plan import ParallelPlan, PlanError, contiguous_blocks

# name -> the submodule that defines it; loaded on first use
_HOMES = {
    "ParallelPlan": "plan",
    "PlanError": "plan",
    "contiguous_blocks": "plan",
    "load_directives": "directives",
    "plan_from_directives": "directives",
}

__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_attributes(__name__, _HOMES)
