"""Files: checkpoints (config: which family and config a directory holds, and its special-token ids; safetensors:
streamed reading and sharded writing; load; save; atomic: directories written whole or not at all; dtypes: the
dtype names zoo accepts), tokenizers and chat templates, LLaVA's image files, and paths that stay inside a
directory the user named."""
