"""Transformer layers written with sharktank.ops: one forward serves unsharded, TP and PP."""

from .attention import attention, causal_mask
from .ffn import swiglu_ffn
from .moe import ROUTINGS, moe_ffn, route
from .rotary import apply_rotary, rope_inv_freq, rotary_angles, rotary_cos, rotary_cos_sin, rotary_sin

__all__ = ["attention", "causal_mask", "swiglu_ffn", "moe_ffn", "route", "ROUTINGS", "apply_rotary", "rope_inv_freq", "rotary_angles", "rotary_cos", "rotary_sin", "rotary_cos_sin"]
