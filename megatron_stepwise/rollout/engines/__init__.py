"""The engines: the `Engine` protocol, SGLang over HTTP, the embedded CPU engine; no fleet or agent loop."""
