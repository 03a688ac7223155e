"""Files: checkpoints (streamed safetensors, zoo and Hugging Face layouts, atomic writes), paths that stay inside a
directory the user named, LLaVA's image files."""
