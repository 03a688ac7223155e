"""The training recipes: python -m recipes.pretrain | sft | dpo | llava | pretokenize."""

import zoo  # noqa: F401  (first: it sets OpenMP's wait policy before torch loads)
