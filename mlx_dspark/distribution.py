"""The distribution this package is installed as, and a check that no other
installed distribution also provides the import package ``mlx_dspark``.

The check reads every installed distribution's metadata (about 0.1 s), so it
runs once per process, when a drafter is first loaded or the ``mlx_dspark``
command runs, never at interpreter start."""

import functools
import re
import sys

DISTRIBUTION = "mlx-lm-dspark"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def other_providers() -> list:
    """The installed distributions other than this one that provide
    ``mlx_dspark``."""
    from importlib.metadata import packages_distributions

    providers = packages_distributions().get("mlx_dspark", ())
    return sorted({p for p in providers if _normalized(p) != DISTRIBUTION})


@functools.cache
def warn_about_other_providers() -> None:
    others = other_providers()
    if others:
        print(
            f"{DISTRIBUTION}: the import package mlx_dspark is also installed by "
            f"{', '.join(others)}, and each overwrites the other's files; run "
            f"`pip uninstall {' '.join(others)} {DISTRIBUTION}`, then "
            f"`pip install {DISTRIBUTION}`.",
            file=sys.stderr,
        )
