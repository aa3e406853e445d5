"""dsv41attn: the DeepSeek-V4.1 attention layer, exactly as DeepSeek's reference defines it."""
from .cache import AttentionState, StateError
from .checkpoint import (CheckpointError, LayerWeights, load_layer_weights, random_layer_weights,
                         write_synthetic_checkpoint)
from .config import AttentionConfig, ConfigError, Role, load_config, preset
from .layer import AttentionLayer
from .stack import AttentionStack, Step

__all__ = [
    "AttentionConfig", "AttentionLayer", "AttentionStack", "AttentionState", "CheckpointError",
    "ConfigError", "LayerWeights", "Role", "StateError", "Step", "load_config",
    "load_layer_weights", "preset", "random_layer_weights", "write_synthetic_checkpoint",
]
