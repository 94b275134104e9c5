"""Hidden-state speculative drafters (DeepSeek's DSpark and DFlash) for mlx-lm."""

from .checkpoints import load_drafter
from .generate import SpeculativeResponse, generate, stream_generate
from .spec.engine import make_prompt_cache, speculative_generate_step
from .spec.stats import Round, SpeculativeStats

__version__ = "0.1.0"

__all__ = [
    "load_drafter",
    "stream_generate",
    "generate",
    "make_prompt_cache",
    "speculative_generate_step",
    "SpeculativeResponse",
    "SpeculativeStats",
    "Round",
]
