"""PipelineRL with in-flight weight updates: FSDP2 trainer ranks and generation ranks in one torchrun job."""

__version__ = "0.1.0"
