"""Finding, reading and loading drafter checkpoints."""

import inspect
import json
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError
from mlx_lm.utils import load_model

from .distribution import warn_about_other_providers
from .plugins import find_drafter_kind

DRAFTER_FILES = ["*.json", "*.safetensors"]

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def resolve_checkpoint(
    path_or_hub_id: Union[str, Path], revision: Optional[str] = None
) -> Path:
    """A local checkpoint directory, or a Hugging Face Hub id resolved through
    ``huggingface_hub`` (its cache; ``HF_HUB_OFFLINE=1`` is honoured)."""
    path = Path(path_or_hub_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path} is a file; pass the checkpoint's directory.")
        return path
    name = str(path_or_hub_id)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ValueError(f"No checkpoint directory at {name}.")
    try:
        return Path(
            snapshot_download(name, revision=revision, allow_patterns=DRAFTER_FILES)
        )
    except (OSError, ValueError, HfHubHTTPError) as e:
        raise ValueError(
            f"{name} is not a local directory and the Hugging Face Hub could not "
            f"provide it ({e}). Download it while online (`hf download {name}`) "
            "or pass the path of a local copy."
        ) from None


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise ValueError(f"{path} has no config.json; is it a model checkpoint?")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} does not hold a JSON object.")
    return config


def require_keys(config: dict, keys, path: Path) -> None:
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise ValueError(
            f"{path}/config.json lacks required field(s) {', '.join(missing)}; "
            "the checkpoint is incomplete or not of the kind its architectures claim."
        )


def parse_dtype(dtype) -> Optional[mx.Dtype]:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    return DTYPES[dtype]


def load_network(path: Path, model_class, args_class, dtype=None, lazy: bool = False):
    """Build ``model_class`` from ``path`` with mlx-lm's loader (shards,
    MLX quantization, strict name/shape checks), with errors that name the
    checkpoint."""
    dtype = parse_dtype(dtype)
    try:
        model, _ = load_model(
            path, lazy=True, get_model_classes=lambda config: (model_class, args_class)
        )
        if dtype is not None:
            model.set_dtype(dtype)
        if not lazy:
            mx.eval(model.parameters())
    except FileNotFoundError:
        raise ValueError(
            f"{path} has no model*.safetensors weights; the download is "
            "incomplete or this is not a checkpoint directory."
        ) from None
    except RuntimeError as e:
        if "safetensors" not in str(e):
            raise
        raise ValueError(
            f"The weights in {path} cannot be read ({e}); the file is corrupt or "
            "truncated. Re-download the checkpoint."
        ) from None
    except ValueError as e:
        raise ValueError(
            f"The weights in {path} do not match its config.json: "
            f"{' '.join(str(e).split()).rstrip('.')}. Re-download the checkpoint, "
            "or check that config.json and the weights belong together."
        ) from None
    return model


def load_drafter(
    path_or_hub_id: Union[str, Path], revision: Optional[str] = None, **options
):
    """Load a drafter checkpoint (a local directory or a Hub id).

    The installed drafter kinds (plugins) decide what the checkpoint is from
    its ``config.json``. ``options`` go to the kind's loader; the DeepSpec
    drafters take ``confidence_threshold`` (default 0: verify every draft),
    ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``) and ``lazy``
    (check the checkpoint without reading the weights yet).
    """
    warn_about_other_providers()
    path = resolve_checkpoint(path_or_hub_id, revision)
    config = read_config(path)
    kind = find_drafter_kind(config, path)
    try:
        inspect.signature(kind.load).bind(path, config, **options)
    except TypeError:
        accepted = list(inspect.signature(kind.load).parameters)[2:]
        raise ValueError(
            f"{kind.name} drafters take the options {', '.join(accepted) or '(none)'}; "
            f"got {', '.join(options)}."
        ) from None
    return kind.load(path, config, **options)
