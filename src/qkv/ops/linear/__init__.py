"""Linear attention (Katharopoulos et al. 2020) and FAVOR+ (Performer): fast forms in
``chunk.py`` and ``recurrent.py``, their slow twins in ``naive.py``, feature maps in
``feature_maps.py``."""

from .chunk import BLOCK, CHUNK_SIZE, LinearState, linear_attention_chunked, linear_attention_global
from .feature_maps import (
    FEATURE_MAPS,
    EluFeatureMap,
    Favor,
    FeatureMap,
    Features,
    ReluFeatureMap,
    resolve_feature_map,
)
from .inputs import LinearInputs, check_eps, prepare
from .naive import linear_attention_loop, linear_attention_quadratic
from .recurrent import LinearAttentionState

__all__ = [
    "BLOCK",
    "CHUNK_SIZE",
    "FEATURE_MAPS",
    "EluFeatureMap",
    "Favor",
    "FeatureMap",
    "Features",
    "LinearAttentionState",
    "LinearInputs",
    "LinearState",
    "ReluFeatureMap",
    "check_eps",
    "linear_attention_chunked",
    "linear_attention_global",
    "linear_attention_loop",
    "linear_attention_quadratic",
    "prepare",
    "resolve_feature_map",
]
