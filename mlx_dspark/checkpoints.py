"""Finding, reading and loading drafter checkpoints."""

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import mlx.core as mx
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError
from mlx_lm.utils import load_model
from safetensors import SafetensorError, safe_open

from .distribution import warn_about_other_providers
from .plugins import find_drafter_kind
from .validation import check, problem

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


def read_json(file: Path) -> dict:
    """A checkpoint's JSON file (``config.json``, ``generation_config.json``)
    as a dict, with errors that name the file."""
    if file.is_dir():
        raise ValueError(f"{file} is a directory, not a JSON file.")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}).") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} cannot be read ({e}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} does not hold a JSON object.")
    return config


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise ValueError(f"{path} has no config.json; is it a model checkpoint?")
    return read_json(file)


# Fields only drafter checkpoints have: a checkpoint with one of them that no
# installed kind claims is a drafter of an unknown layout, not a language model
# for mlx-lm's loader.
DRAFTER_FIELDS = ("target_layer_ids", "backbone_hidden_size")


def looks_like_drafter(config: dict) -> bool:
    return any(key in config for key in DRAFTER_FIELDS)


def tensor_shapes(path: Path) -> Dict[str, Tuple[int, ...]]:
    """The shape of every tensor in the checkpoint's ``model*.safetensors``,
    from the files' headers (no weights are read)."""
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise ValueError(
            f"{path} has no model*.safetensors weights; the download is "
            "incomplete or this is not a checkpoint directory."
        )
    shapes = {}
    for file in files:
        if not file.is_file():
            raise ValueError(f"{file} is not a file; re-download the checkpoint.")
        try:
            with safe_open(str(file), "numpy") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (OSError, SafetensorError) as e:
            raise ValueError(
                f"{file} cannot be read ({e}); the file is corrupt or truncated. "
                "Re-download the checkpoint."
            ) from None
    return shapes


# A size field's upper bound: no tensor dimension of the checkpoint is larger.
LARGEST = "largest"


@dataclass(frozen=True)
class Field:
    """What one config.json field must be (see ``validation.problem``)."""

    kind: str
    low: Optional[float] = None
    high: Optional[Union[float, str]] = None
    required: bool = True
    nullable: bool = False  # an explicit null stands for "none" (else it is an error)


SIZE = Field("integer", 1, LARGEST)
OPTIONAL_SIZE = Field("integer", 1, LARGEST, required=False)
NULLABLE_SIZE = Field("integer", 1, LARGEST, required=False, nullable=True)
FLAG = Field("boolean", required=False)


def require_keys(config: dict, keys, path: Path) -> None:
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise ValueError(
            f"{path}/config.json lacks required field(s) {', '.join(missing)}; "
            "the checkpoint is incomplete or not of the kind its architectures claim."
        )


def field_problems(config: dict, fields: Dict[str, Field], shapes: dict) -> list:
    """Every way ``config`` breaks ``fields``; sizes are bounded by the
    largest tensor dimension in ``shapes``, so that nothing absurd is built."""
    largest = max((d for shape in shapes.values() for d in shape), default=0)
    problems = []
    for name, field in fields.items():
        value = config.get(name)
        if name not in config or (value is None and (field.required or field.nullable)):
            continue  # missing (require_keys reports required ones) or null
        high = largest if field.high == LARGEST else field.high
        wanted = problem(value, field.kind, field.low, high)
        if wanted is not None:
            why = " (no tensor in the weights is larger)" if field.high == LARGEST else ""
            problems.append(f"{name} must be {wanted}{why}, got {value!r}")
    return problems


def check_fields(config: dict, fields: Dict[str, Field], shapes: dict, path: Path, what: str) -> None:
    """Raise one ValueError for missing fields, then one listing every
    field of the wrong type or range."""
    require_keys(config, [k for k, f in fields.items() if f.required], path)
    problems = field_problems(config, fields, shapes)
    if problems:
        raise invalid_config(path, what, problems)


def invalid_config(path: Path, what: str, problems) -> ValueError:
    return ValueError(
        f"{path}/config.json is not a valid {what} config: " + "; ".join(problems) + "."
    )


def layer_count(shapes: dict, prefix: str) -> int:
    """How many layers ``prefix{i}.`` the weights hold (the highest index + 1)."""
    indices = [
        name[len(prefix) :].split(".")[0] for name in shapes if name.startswith(prefix)
    ]
    return 1 + max((int(i) for i in indices if i.isdigit()), default=-1)


def shape_problems(config: dict, shapes: dict, first_dims: Dict[str, str]) -> list:
    """Config fields that disagree with the first dimension of the tensor
    ``first_dims`` maps them to (the first dimension survives quantization)."""
    problems = []
    for field, tensor in first_dims.items():
        if tensor not in shapes:
            problems.append(f"the weights have no {tensor}")
        elif config[field] != shapes[tensor][0]:
            problems.append(
                f"{field} is {config[field]} but {tensor} has {shapes[tensor][0]} rows"
            )
    return problems


def parse_dtype(dtype) -> Optional[mx.Dtype]:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    return DTYPES[dtype]


def load_network(path: Path, model_class, args_class, dtype=None, lazy: bool = False):
    """Build ``model_class`` from ``path`` with mlx-lm's loader (shards,
    MLX quantization, strict name/shape checks), with errors that name the
    checkpoint."""
    dtype = parse_dtype(dtype)
    check(lazy, "lazy", "boolean")
    try:
        model, _ = load_model(
            path, lazy=True, get_model_classes=lambda config: (model_class, args_class)
        )
        if dtype is not None:
            model.set_dtype(dtype)
        if not lazy:
            mx.eval(model.parameters())
    except OverflowError as e:
        raise ValueError(
            f"{path}/config.json describes tensors too large to build ({e})."
        ) from None
    except OSError as e:
        raise ValueError(f"A file of {path} cannot be read ({e}).") from None
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
    if not isinstance(path_or_hub_id, (str, Path)):
        raise ValueError(
            "path_or_hub_id must be a directory or a Hugging Face Hub id (str or "
            f"Path), got {type(path_or_hub_id).__name__}."
        )
    if revision is not None and not isinstance(revision, str):
        raise ValueError(f"revision must be a string, got {revision!r}.")
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
