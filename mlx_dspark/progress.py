"""Progress bars for jobs that can take minutes, as mlx-lm draws them: tqdm
on stderr, shown only when stderr is a terminal (``disable=None``)."""

from tqdm import tqdm


def progress(iterable=None, **kwargs) -> tqdm:
    """``tqdm(iterable, **kwargs)``, quiet when stderr is not a terminal."""
    kwargs.setdefault("disable", None)
    kwargs.setdefault("leave", False)
    return tqdm(iterable, **kwargs)
