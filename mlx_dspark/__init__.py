"""Hidden-state speculative drafters (DeepSeek's DSpark and DFlash) for mlx-lm.

The package imports lazily: ``import mlx_dspark`` costs nothing until one of
the names below is used, because the auto-activation hook (see
``mlx_dspark.activation``) imports it at every interpreter start.
"""

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing at startup

__version__ = "0.1.0"

_EXPORTS = {
    "load_drafter": "mlx_dspark.checkpoints",
    "stream_generate": "mlx_dspark.generation",
    "generate": "mlx_dspark.generation",
    "SpeculativeResponse": "mlx_dspark.generation",
    "make_prompt_cache": "mlx_dspark.speculative.engine",
    "speculative_generate_step": "mlx_dspark.speculative.engine",
    "SpeculativeStats": "mlx_dspark.speculative.stats",
    "make_sampler": "mlx_dspark.speculative.sampling",
    "Round": "mlx_dspark.speculative.stats",
}

__all__ = [
    "load_drafter",
    "stream_generate",
    "generate",
    "SpeculativeResponse",
    "make_prompt_cache",
    "speculative_generate_step",
    "SpeculativeStats",
    "Round",
    "make_sampler",
]


def __getattr__(name):
    if name in _EXPORTS:
        from importlib import import_module

        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mlx_dspark' has no attribute {name!r}")


if TYPE_CHECKING:
    from .checkpoints import load_drafter
    from .generation import SpeculativeResponse, generate, stream_generate
    from .speculative.engine import make_prompt_cache, speculative_generate_step
    from .speculative.sampling import make_sampler
    from .speculative.stats import Round, SpeculativeStats
