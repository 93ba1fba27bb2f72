"""twostage-mla: exact Decode Context Parallel attention for q_len > 1.

Public names::

    DCPLayout, AttentionConfig, TwoStageAttention   the layer and its setup
    StepPlan, plan_step                             per-step metadata
    merge_state, merge_states, merge_state_         attention-state algebra
    oracle_attention                                float64 reference to check against
    build_shard                                     a rank's paged cache from whole K/V
"""

from twostage_mla.cache import build_shard
from twostage_mla.layer import AttentionConfig, TwoStageAttention
from twostage_mla.layout import DCPLayout
from twostage_mla.oracle import oracle_attention
from twostage_mla.plan import StepPlan, plan_step
from twostage_mla.state import merge_state, merge_state_, merge_states

__all__ = [
    "AttentionConfig",
    "DCPLayout",
    "StepPlan",
    "TwoStageAttention",
    "build_shard",
    "merge_state",
    "merge_state_",
    "merge_states",
    "oracle_attention",
    "plan_step",
]
__version__ = "0.1.0"
