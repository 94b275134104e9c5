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


def providers(package: str = "mlx_dspark") -> list:
    """The installed distributions that provide ``package``: by their files
    or, installed in editable mode, by a ``.pth`` path to a directory that
    holds it."""
    import importlib.metadata
    from pathlib import Path

    names = set(importlib.metadata.packages_distributions().get(package, []))
    for dist in importlib.metadata.distributions():
        for file in dist.files or ():
            if file.suffix != ".pth":
                continue
            try:
                lines = file.read_text().splitlines()
            except (OSError, UnicodeDecodeError):
                continue
            if any((Path(line.strip()) / package).is_dir() for line in lines):
                names.add(dist.metadata["Name"])
    return sorted(names)


def other_providers() -> list:
    """The installed distributions other than this one that provide
    ``mlx_dspark``."""
    return [p for p in providers() if _normalized(p) != DISTRIBUTION]


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
