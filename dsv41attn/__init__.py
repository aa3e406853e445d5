"""dsv41attn: the DeepSeek-V4.1 attention layer, exactly as DeepSeek's reference defines it."""
from .ops.common.cpu_kernels import pin_mkl_branch

pin_mkl_branch()  # first: MKL reads its code path at its first call (ops/common/cpu_kernels.py)

from .cache import AttentionState, StateError
from .checkpoint import (CheckpointError, LayerWeights, load_layer_weights, random_layer_weights,
                         write_synthetic_checkpoint)
from .config import AttentionConfig, ConfigError, ConfigWarning, Role, load_config, preset
from .layer import AttentionLayer
from .stack import AttentionStack, Step


def _version() -> str:
    """The installed distribution's version; for a source tree that is not installed, the
    version in its pyproject.toml (the one place it is written)."""
    import os
    import re
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dsv41attn")
    except PackageNotFoundError:
        pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "pyproject.toml")
        try:
            with open(pyproject, encoding="utf-8") as f:
                m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), flags=re.M)
        except OSError:
            m = None
        return m[1] if m else "0+unknown"


__version__ = _version()

__all__ = [
    "AttentionConfig", "AttentionLayer", "AttentionStack", "AttentionState", "CheckpointError",
    "ConfigError", "ConfigWarning", "LayerWeights", "Role", "StateError", "Step", "load_config",
    "load_layer_weights", "preset", "random_layer_weights", "write_synthetic_checkpoint",
    "__version__",
]
