"""The embedded CPU engine: HF model, sampling, batched decode, and its SGLang-compatible server."""
