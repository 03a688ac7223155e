"""python -m zoo.generate CKPT --prompt ... | --chat: the command line (zoo.generate.cli)."""

from zoo.generate.cli import main

raise SystemExit(main())
