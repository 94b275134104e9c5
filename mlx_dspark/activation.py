"""Auto-activation into mlx-lm's ``mlx_lm.generate`` and ``mlx_lm.server``.

``install()`` runs at every interpreter start, from the ``mlx_dspark.pth``
import line (Python <= 3.14) or the ``mlx_dspark.start`` entry point (Python
>= 3.15, PEP 829; when both files exist there, the ``.pth`` import line is
ignored). It only adds an import hook, using the standard library: nothing of
MLX or mlx-lm is imported until a program imports ``mlx_lm.generate`` or
``mlx_lm.server`` itself. Then, right after that module has executed, the
patches in ``mlx_dspark.integration`` are applied to it.

Set ``MLX_DSPARK_DISABLE=1`` to switch this off. The ``.pth`` line reads it
itself (the same rule as ``disabled()``), so that a disabled interpreter
imports nothing of mlx-dspark.
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
    """Runs the real loader; for mlx-lm's modules, then patches the result.

    The patches import mlx-dspark's own modules. When mlx-lm's module is
    imported *by* one of them (``import mlx_dspark.cache`` imports
    ``mlx_lm.models``, whose package imports ``mlx_lm.generate``), patching
    there would re-enter a half-executed module; the hook therefore counts the
    mlx-dspark modules executing and patches once the outermost is done."""

    def __init__(self, loader, hook, ours):
        self._loader = loader
        self._hook = hook
        self._ours = ours

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        hook = self._hook
        if not self._ours:
            self._loader.exec_module(module)
            hook.pending.append(module)
        else:
            hook.executing += 1
            try:
                self._loader.exec_module(module)
            finally:
                hook.executing -= 1
        if hook.executing == 0:
            hook.patch_pending()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class PostImportHook:
    """A ``sys.meta_path`` finder that wraps the loaders of ``TARGETS`` (to
    patch them) and of mlx-dspark's modules (to know when patching is safe)."""

    def __init__(self):
        self.executing = 0
        self.pending = []

    def find_spec(self, fullname, path, target=None):
        ours = fullname.startswith("mlx_dspark.")
        if not (ours or fullname in TARGETS) or disabled():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, self, ours)
                return spec
        return None

    def patch_pending(self):
        while self.pending:
            module = self.pending.pop(0)
            from .integration import patch_module

            patch_module(module)


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
