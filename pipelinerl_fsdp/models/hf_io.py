"""HF checkpoint folders: config.json + one or many safetensors shards (+ model.safetensors.index.json)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipelinerl_fsdp.models.args import ModelArgs
from pipelinerl_fsdp.models.decoder import Transformer

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_json(path: Path) -> Any:
    """A JSON file's content; a file that does not parse is an error naming it, with line and column."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from e


def read_model_args(folder: str | Path) -> ModelArgs:
    """ModelArgs from `folder/config.json`."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json; is {folder} an HF model folder?")
    try:
        return ModelArgs.from_hf_config(read_json(path))
    except KeyError as e:
        raise ValueError(f"{path}: no {e.args[0]!r} (not a decoder config this project can build)") from e


@contextmanager
def open_shard(path: Path) -> Iterator[Any]:
    """`safe_open` of one shard; a missing or unreadable (truncated, not safetensors) file is an error naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: listed in {INDEX_NAME} but missing")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors' own errors do not name the file
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
    with handle as f:
        yield f


def _shard_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no 'weight_map' table")
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / SINGLE_NAME
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return files


def weights_fingerprint(folder: str | Path, head_bytes: int = 1 << 20, samples: int = 32) -> str:
    """A short hash of an HF folder's weights: config.json and, for every weight file, its name, size, first
    `head_bytes` (the safetensors header: every tensor's name, shape, dtype and offsets) and `samples` 64 KiB
    chunks spread evenly over the rest (so two models that share their first tensors, e.g. a base and the merge of
    an adapter into it, still differ). Cheap at any model size; it changes when the folder holds other weights,
    not when it is moved or copied."""
    folder = Path(folder)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in _shard_files(folder):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}:".encode())
        with f.open("rb") as fh:
            h.update(fh.read(head_bytes))
            for i in range(samples):
                fh.seek(head_bytes + (size - head_bytes) * i // samples if size > head_bytes else size)
                h.update(fh.read(1 << 16))
    return h.hexdigest()[:16]


def read_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard of an HF folder, on CPU, in the stored dtype."""
    out: dict[str, torch.Tensor] = {}
    for path in _shard_files(Path(folder)):
        with open_shard(path) as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def read_tensors(folder: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Only these tensors of an HF folder, on CPU, in the stored dtype (the other shards' contents are not read);
    a name the folder lacks is an error naming it."""
    wanted, out = set(names), {}
    for path in _shard_files(Path(folder)):
        with open_shard(path) as f:
            for key in wanted.intersection(f.keys()):
                out[key] = f.get_tensor(key)
    missing = sorted(wanted - out.keys())
    if missing:
        raise KeyError(f"{folder}: no tensor {missing[:3]} ({len(missing)} missing)")
    return out


def _check_names(folder: str | Path, model: Transformer, stored: set[str]) -> set[str]:
    """The parameter names to load (the tied head is the embedding); a mismatch with the files is an error."""
    tied = model.args.tie_word_embeddings
    # LoRA adapters (models/lora.py) are not in an HF folder: they start from their own initial values
    expected = {k for k in model.state_dict() if not (tied and k == "lm_head.weight") and ".lora_" not in k}
    if tied:
        stored = stored - {"lm_head.weight"}
    missing, unexpected = expected - stored, stored - expected
    # Some exporters store rotary inv_freq buffers; they are derived from the config, never weights.
    unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise ValueError(
            f"{folder}: checkpoint does not match config.json: missing {sorted(missing)[:8]}, "
            f"unexpected {sorted(unexpected)[:8]}"
        )
    return expected


def load_hf_model(
    folder: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """Our Transformer with the weights of an HF folder (strict: missing or unexpected names are an error)."""
    args = read_model_args(folder)
    with torch.device("meta"):
        model = Transformer(args)
    sd = read_state_dict(folder)
    expected = _check_names(folder, model, set(sd))
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items() if k in expected}, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device)


def save_hf_folder(
    folder: str | Path,
    args: ModelArgs,
    state_dict: dict[str, torch.Tensor],
    max_shard_bytes: int = 2 * 1024**3,
    dtype: torch.dtype | None = None,
) -> None:
    """Write config.json and safetensors shards (with an index when more than one) that transformers and vLLM load.

    `state_dict` holds full (unsharded) tensors with HF names; the tied lm_head is not stored.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu", dtype or v.dtype).contiguous()
        for k, v in state_dict.items()
        if not (args.tie_word_embeddings and k == "lm_head.weight")
    }
    stored_dtype = next(iter(tensors.values())).dtype
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    for stale in list(folder.glob("*.safetensors")) + [folder / INDEX_NAME]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE_NAME), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(folder / INDEX_NAME, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(folder / "config.json", "w") as f:
        json.dump(args.to_hf_config(_DTYPE_NAMES.get(stored_dtype, "float32")), f, indent=2)


def load_shards_into(model: Transformer, folder: str | Path) -> None:
    """Fill a model whose parameters are FSDP2-sharded DTensors (materialised, e.g. with `to_empty`) from an HF
    folder, each rank reading only its own rows of each tensor (`get_slice`): no rank reads, or holds, a tensor
    it does not own, let alone the whole model. Plain tensors (no sharding) are read whole."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    folder = Path(folder)
    where: dict[str, Path] = {}
    for path in _shard_files(folder):
        with open_shard(path) as f:
            where.update({k: path for k in f.keys()})
    names = _check_names(folder, model, set(where))
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for name in sorted(names):
        by_file.setdefault(where[name], []).append(name)
    with torch.no_grad():
        for path, keys in by_file.items():
            with open_shard(path) as f:
                for name in keys:
                    p = params[name]
                    stored = f.get_slice(name)
                    if list(stored.get_shape()) != list(p.shape):
                        raise ValueError(
                            f"{path}: {name} has shape {stored.get_shape()}, config.json says {list(p.shape)}"
                        )
                    if isinstance(p, DTensor):
                        local = p.to_local()
                        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                        if local.numel():
                            index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                            local.copy_(stored[index].to(local.dtype))
                    else:
                        p.copy_(stored[:].to(p.dtype))
