"""Files: checkpoints (streamed safetensors, zoo and Hugging Face layouts, atomic writes), tokenizers and chat
templates, LLaVA's image files, and paths that stay inside a directory the user named."""
