"""The patches that make ``mlx_lm.generate`` and ``mlx_lm.server`` accept
hidden-state drafters (applied by ``mlx_dspark.activation`` or by the
``mlx_dspark`` command). Each patch replaces one module attribute and keeps the
original, so ``unpatch_module`` restores mlx-lm exactly; applying twice is a
no-op. mlx-lm versions outside the tested range are left alone.

The replacements (``hooks``) pass through to mlx-lm unless a draft model is
involved; the modules that do the work load on first use."""

import sys

from . import hooks

TESTED_MLX_LM = ((0, 32), (0, 33))  # >= 0.32, < 0.33


def mlx_lm_version_supported(version: str) -> bool:
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    low, high = TESTED_MLX_LM
    return low <= major_minor < high


def _generate_patches(module):
    from ..speculative import sampling

    sample_utils = sys.modules["mlx_lm.sample_utils"]
    return [
        (module, "load", hooks.load(module.load)),
        (module, "make_sampler", sampling.make_sampler),
        (sample_utils, "make_sampler", sampling.make_sampler),
        (
            module,
            "speculative_generate_step",
            hooks.speculative_generate_step(module.speculative_generate_step),
        ),
        (module, "generate", hooks.generate(module.generate)),
        (
            module,
            "main",
            hooks.main(
                module.main,
                "mlx_lm.generate",
                module.DEFAULT_MODEL,
                with_processors=True,
            ),
        ),
    ]


def _server_patches(module):
    from ..speculative import sampling

    generator, handler = module.ResponseGenerator, module.APIHandler
    return [
        (module, "load", hooks.load(module.load)),
        (module, "make_sampler", sampling.make_sampler),
        (
            module,
            "make_prompt_cache",
            hooks.make_prompt_cache(module.make_prompt_cache),
        ),
        (
            generator,
            "_next_request",
            hooks.next_request(generator._next_request, module.GenerationContext),
        ),
        (generator, "_serve_single", hooks.serve_single(generator._serve_single)),
        (module.ModelProvider, "load", hooks.provider_load(module.ModelProvider.load)),
        (module, "BatchGenerator", hooks.batch_generator(module.BatchGenerator)),
        (generator, "generate", hooks.remember_statistics(generator.generate)),
        (
            handler,
            "generate_response",
            hooks.with_speculative_usage(handler.generate_response),
        ),
        (
            handler,
            "completion_usage_response",
            hooks.with_speculative_usage(handler.completion_usage_response),
        ),
        (
            handler,
            "validate_model_parameters",
            hooks.checking_requests(handler.validate_model_parameters),
        ),
        (module, "main", hooks.main(module.main, "mlx_lm.server")),
    ]


PATCHES = {"mlx_lm.generate": _generate_patches, "mlx_lm.server": _server_patches}


def patch_module(module) -> bool:
    """Patch ``mlx_lm.generate`` or ``mlx_lm.server``; returns whether the
    module is (now) patched."""
    if getattr(module, "_mlx_dspark_originals", None) is not None:
        return True
    import mlx_lm

    if not mlx_lm_version_supported(mlx_lm.__version__):
        print(
            f"mlx-dspark: mlx-lm {mlx_lm.__version__} is untested (mlx-dspark "
            "supports mlx-lm >=0.32,<0.33); hidden-state drafters are not "
            "available in mlx_lm's commands. Install a supported mlx-lm, or set "
            "MLX_DSPARK_DISABLE=1 to silence this.",
            file=sys.stderr,
        )
        return False
    originals = []
    for owner, name, replacement in PATCHES[module.__name__](module):
        originals.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, replacement)
    module._mlx_dspark_originals = originals
    return True


def unpatch_module(module) -> None:
    """Restore what ``patch_module`` replaced."""
    for owner, name, original in getattr(module, "_mlx_dspark_originals", None) or ():
        setattr(owner, name, original)
    module._mlx_dspark_originals = None
