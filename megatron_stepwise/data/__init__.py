"""Data readers: the prompt dataset, sample files (JSONL, Parquet, datasets), synthetic batches."""
