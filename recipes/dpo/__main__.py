"""python -m recipes.dpo: the recipe of recipes/dpo/__init__.py."""

from recipes.dpo import main
from recipes.engine.command import cli

cli(main)
