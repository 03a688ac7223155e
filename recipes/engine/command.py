"""How a command ends: `cli(main)` runs a recipe's (or the tokenizer's) main, and bad input ends the process with
one line, `error: ...`, and exit code 2. Nothing here imports torch, so a command that needs none starts fast."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from zoo.errors import ZooError


def cli(main: Callable[[], Any]) -> None:
    """A recipe's `__main__`: bad input (a ZooError) is one line `error: ...` on stderr and exit code 2 (under
    torchrun printed once per node: exit_with_error)."""
    try:
        main()
    except ZooError as e:
        exit_with_error(str(e))
    except OSError as e:  # a full disk while saving: the checkpoint being written stays a temporary directory
        exit_with_error(f"{e.strerror or e} ({e.filename or 'writing the run'}); the last complete checkpoint is "
                        f"intact (--resume)")


def exit_with_error(message: str) -> NoReturn:
    """End this process for bad input: `error: MESSAGE` on stderr, exit code 2, at once (no collective, no wait for
    the other ranks, which torchrun stops when one fails).

    Under torchrun every rank meets the same bad input, so only each node's first rank (LOCAL_RANK 0) prints the
    line: once per node, so one machine prints it once, and each node's own log says why. A node cannot leave that to
    its torchrun agent: the agent on the rendezvous host exits as soon as its worker fails, and an agent on another
    node whose worker is still exiting then loses the rendezvous and dies with a connection error instead of its
    report. Every rank also writes the line to torchrun's error file (TORCHELASTIC_ERROR_FILE), where torchrun's
    closing report shows it as the root cause's `traceback :` line, its next to last line: one rank's own error (its
    GPU, its file system) is not lost there either. torchrun itself exits 1 with that report; it cannot be made
    shorter from a worker (its own traceback and the report come after the workers have exited)."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:  # the layout torchrun's own @record writes (a plain string message makes it log two warnings more)
            record = {"message": f"error: {message}", "extraInfo": {"timestamp": str(int(time.time()))}}
            with open(error_file, "w") as f:
                json.dump({"message": record}, f)
        except OSError:
            pass  # the report then says less; the exit code still says it failed
    sys.exit(2)
