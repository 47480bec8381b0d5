"""Decoder family (Llama / Qwen2 / Qwen3) with HF-compatible names, HF folder I/O and debug flavours."""

from pipelinerl_fsdp.models.args import FLAVOURS, ModelArgs, flavour_args
from pipelinerl_fsdp.models.decoder import Transformer, build_model
from pipelinerl_fsdp.models.hf_io import load_hf_model, read_model_args, read_state_dict, save_hf_folder

__all__ = [
    "FLAVOURS",
    "ModelArgs",
    "Transformer",
    "build_model",
    "flavour_args",
    "load_hf_model",
    "read_model_args",
    "read_state_dict",
    "save_hf_folder",
]
