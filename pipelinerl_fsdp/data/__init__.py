"""Problems from files: reading records (JSONL, parquet, `datasets` folders) and mapping their fields to a
question and a gold answer (presets for the common layouts)."""
