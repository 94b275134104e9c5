"""Extension points: drafter kinds and target adapters.

mlx-dspark finds what it can run through pluggy plugins registered under the
entry-point group ``mlx_dspark``. The built-in DeepSpec drafters and the
Gemma-4 target adapter are registered exactly the way a third party would
register its own, in ``pyproject.toml``::

    [project.entry-points.mlx_dspark]
    my_drafter = "my_package.my_drafter_module"

The module named there implements one or both hooks below with
``@mlx_dspark.plugins.hookimpl``. Each hook returns descriptors; mlx-dspark
does the matching, so a plugin never needs to know about the others.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

import pluggy

PROJECT = "mlx_dspark"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class DrafterKind:
    """A family of drafter checkpoints this plugin can load.

    Args:
        name: Short name shown to users and in statistics (e.g. ``"dspark"``).
        architectures: The ``config.json`` ``architectures[0]`` values this kind
            claims. Used in error messages that list what is installed.
        detect: ``detect(config) -> bool``: whether the parsed ``config.json``
            of a checkpoint belongs to this kind.
        load: ``load(path, config, **options) -> Drafter``: build the drafter
            from a local checkpoint directory. Raise ``ValueError`` with a
            message that says what is wrong and what to do for bad checkpoints
            or options.
    """

    name: str
    architectures: tuple
    detect: Callable[[dict], bool]
    load: Callable[..., Any]


@dataclass(frozen=True)
class TargetAdapter:
    """Support for one family of mlx-lm models as speculative targets.

    Args:
        name: Short name (e.g. ``"gemma4"``).
        supports: ``supports(model) -> bool`` for a model returned by
            ``mlx_lm.load``.
        adapt: ``adapt(model) -> Target``: wrap the model *instance* (never
            patch its class) in an object that runs a tapped forward (logits
            plus the raw outputs of requested layers, logits bit-identical to
            the model's own forward) and makes caches that can roll back a
            rejected draft at any context length. See
            :class:`mlx_dspark.targets.base.Target`.
    """

    name: str
    supports: Callable[[Any], bool]
    adapt: Callable[[Any], Any]


class Hookspecs:
    @hookspec
    def mlx_dspark_drafter_kinds(self) -> List[DrafterKind]:
        """Return the drafter kinds this plugin provides.

        ``mlx_dspark.load_drafter`` reads a checkpoint's ``config.json`` and
        asks every kind's ``detect``; exactly one kind must claim it.
        """

    @hookspec
    def mlx_dspark_target_adapters(self) -> List[TargetAdapter]:
        """Return the target adapters this plugin provides.

        The engine asks every adapter's ``supports`` about the target model;
        the first adapter that supports it is used.
        """


def architecture(config: dict) -> Optional[str]:
    """``architectures[0]`` of a parsed ``config.json``, if it is a string."""
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        name = architectures[0]
        return name if isinstance(name, str) else None
    return None


def make_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh plugin manager, with the installed ``mlx_dspark`` plugins loaded."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(Hookspecs)
    if load_entry_points:
        try:
            pm.load_setuptools_entrypoints(PROJECT)
        except Exception as e:
            raise RuntimeError(
                f"An installed mlx_dspark plugin failed to load ({type(e).__name__}: "
                f"{e}). Reinstall or uninstall the package that provides it."
            ) from e
    return pm


_manager: Optional[pluggy.PluginManager] = None


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created on first use."""
    global _manager
    if _manager is None:
        _manager = make_plugin_manager()
    return _manager


def drafter_kinds(pm: Optional[pluggy.PluginManager] = None) -> List[DrafterKind]:
    pm = pm or plugin_manager()
    return [k for kinds in pm.hook.mlx_dspark_drafter_kinds() for k in kinds]


def target_adapters(pm: Optional[pluggy.PluginManager] = None) -> List[TargetAdapter]:
    pm = pm or plugin_manager()
    return [a for adapters in pm.hook.mlx_dspark_target_adapters() for a in adapters]


def _installed_summary(kinds) -> str:
    if not kinds:
        return (
            "no drafter kinds are installed (is mlx-dspark installed with pip, "
            "so that its entry points are registered?)"
        )
    return "installed kinds: " + ", ".join(
        f"{k.name} ({', '.join(k.architectures)})" for k in kinds
    )


def find_drafter_kind(
    config: dict, path: Path, pm: Optional[pluggy.PluginManager] = None
) -> DrafterKind:
    kinds = drafter_kinds(pm)
    matches = [k for k in kinds if k.detect(config)]
    if len(matches) == 1:
        return matches[0]
    architectures = config.get("architectures")
    if not matches:
        raise ValueError(
            f"{path} is not a drafter checkpoint mlx-dspark can load: its "
            f"config.json has architectures={architectures!r} and "
            f"model_type={config.get('model_type')!r}; "
            f"{_installed_summary(kinds)}. For an ordinary language model "
            "draft, use mlx_lm's own draft_model= instead."
        )
    raise ValueError(
        f"{path}: several drafter kinds claim this checkpoint "
        f"({', '.join(k.name for k in matches)}); uninstall one of the plugins "
        "that provide them."
    )


def find_target_adapter(model, pm: Optional[pluggy.PluginManager] = None):
    adapters = target_adapters(pm)
    for adapter in adapters:
        if adapter.supports(model):
            return adapter
    names = ", ".join(a.name for a in adapters) or "none"
    raise ValueError(
        f"The target model ({type(model).__module__}.{type(model).__name__}, "
        f"model_type={getattr(model, 'model_type', None)!r}) is not supported "
        f"for hidden-state drafting; installed target adapters: {names}."
    )
