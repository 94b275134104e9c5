"""Auto-activation into mlx-lm's ``mlx_lm.generate`` and ``mlx_lm.server``.

``install()`` runs at every interpreter start, from the ``mlx_dspark.pth``
import line (Python <= 3.14) or the ``mlx_dspark.start`` entry point (Python
>= 3.15, PEP 829; when both files exist there, the ``.pth`` import line is
ignored). It only adds an import hook, using the standard library: nothing of
MLX or mlx-lm is imported until a program imports ``mlx_lm.generate`` or
``mlx_lm.server`` itself. Then, right after that module has executed, the
patches in ``mlx_dspark.integration`` are applied to it.

Set ``MLX_DSPARK_DISABLE=1`` to switch this off.
"""

import os
import sys

TARGETS = ("mlx_lm.generate", "mlx_lm.server")


def disabled() -> bool:
    return os.environ.get("MLX_DSPARK_DISABLE", "").strip().lower() not in (
        "",
        "0",
        "false",
        "no",
    )


class _PatchingLoader:
    """Runs the real loader, then patches the module it produced."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        from .integration import patch_module

        patch_module(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class PostImportHook:
    """A ``sys.meta_path`` finder that wraps the loaders of ``TARGETS``."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS or disabled():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Activate mlx-dspark for mlx-lm's modules; idempotent and cheap."""
    if disabled():
        return
    if not any(isinstance(f, PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, PostImportHook())
    already = [sys.modules[name] for name in TARGETS if name in sys.modules]
    if already:
        from .integration import patch_module

        for module in already:
            patch_module(module)
