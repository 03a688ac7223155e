"""What rendering a checkpoint's chat template may do (zoo.io.chat_template enforces it): the bounds, the budget of
one rendering, and the size of what an operation would build, computed before it is built.

The bounds grow with the conversation and sit far above what real templates need (Llama 3.x, Qwen2.5, Mistral,
InternLM2 and Phi-3 take a few hundred steps per message and print their input about once).
"""

from __future__ import annotations

import functools
import inspect
import re
import string
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextvars import ContextVar
from itertools import chain
from typing import Any

from jinja2.utils import Namespace

from zoo.errors import ZooError

MAX_TEMPLATE = 1 << 20  # characters of the template itself (real ones are a few thousand)
MAX_CHARS = 1 << 24  # characters of one string, list (as printed) or the output; plus 8 per input character
MAX_BUILT = 1 << 26  # characters built over one rendering; plus 64 per input character
MAX_STEPS = 1 << 21  # loop iterations weighted by the size of the loop body, and calls; plus 64 per input character
MAX_DEPTH = 64  # nested calls (a recursive macro): reached well before Python's recursion limit
MAX_INT_BITS = 1 << 16  # an integer's size (Python prints at most 4300 digits, about 14,000 bits)
MAX_RANGE = 100_000  # items of a range(), as in jinja's sandbox
MAX_SECONDS = 2.0  # of CPU, plus 1 per million input characters: for what the counts miss (comparing long strings)
REMEDY = "fix the template, or pick a built-in one (--chat-template internlm2|llama-2|llama-3)"


class ChatTemplateError(ZooError):
    """A checkpoint's chat template that cannot render at all (not UTF-8, a syntax error, past a bound). Unlike a
    template refusing one conversation (raise_exception), it is never passed over."""


class Exceeded(Exception):  # not a ValueError or TypeError: jinja's |int and |float swallow those
    """A template went past a bound; the message says which."""


def as_int(x: object) -> int:
    return x if isinstance(x, int) else 0


def bits(n: int) -> None:
    if n > MAX_INT_BITS:
        raise Exceeded(f"exceeded {MAX_INT_BITS}-bit integers ({n} bits asked for)")


class Budget:
    """What one rendering may still do, and the sizes of the containers it has seen (they cannot change: the
    immutable sandbox allows no list or dict method that mutates)."""

    def __init__(self, input_chars: int = 0) -> None:
        self.cap = MAX_CHARS + 8 * input_chars
        self.built = self.max_built = MAX_BUILT + 64 * input_chars
        self.steps = self.max_steps = MAX_STEPS + 64 * input_chars
        self.depth = self._ticks = 0
        self.seconds = MAX_SECONDS + input_chars / 1e6
        self._deadline = time.thread_time() + self.seconds  # this thread's CPU: a busy machine does not count
        self._sizes: dict[int, tuple[object, int]] = {}  # id -> (container, size); holding it keeps the id its own
        self._open: set[int] = set()  # containers being sized (a namespace may hold itself)

    def step(self, n: int = 1) -> None:
        self.steps -= n
        if self.steps < 0:
            raise Exceeded(f"exceeded {self.max_steps} steps (loop iterations weighted by the size of the loop "
                            "body, and calls)")
        self._ticks += 1
        if self._ticks % 64 == 0 and time.thread_time() > self._deadline:  # (a clock read costs ten steps)
            raise Exceeded(f"exceeded {self.seconds:.1f} s of CPU time")

    def build(self, n: int) -> None:
        self.built -= n
        if self.built < 0:
            raise Exceeded(f"exceeded {self.max_built} characters built in all")

    def fits(self, size: int) -> None:
        """Refuses to build a string or list of `size` characters or items, or to print one, past the cap."""
        if size > self.cap:
            raise Exceeded(f"exceeded {self.cap} characters in one string, list or output ({size} asked for)")

    def made(self, value: Any) -> Any:
        """`value`, just built, checked against the bounds and paid for."""
        if isinstance(value, int):
            bits(value.bit_length())  # + and - grow an integer a bit at a time
        elif isinstance(value, str | bytes):
            self.fits(len(value))
            self.build(len(value))
        elif isinstance(value, Collection | Namespace):
            self.fits(self.size(value))
            self.build(len(value) if isinstance(value, Collection) else 1)
        return value

    def join(self, pieces: Iterable[str]) -> str:
        """"".join(pieces), stopping at the cap (the output, a macro's or block's text, tojson's)."""
        kept, n = [], 0
        for piece in pieces:
            n += len(piece)
            self.fits(n)
            kept.append(piece)
        self.build(n)
        return "".join(kept)

    def size(self, value: object) -> int:
        """About how many characters `value` prints as, without printing it: a list may hold one long string many
        times over (`[x, x]` nested 40 deep), and printing it, comparing, hashing or sorting it walks every copy."""
        if isinstance(value, str | bytes):
            return len(value)
        if isinstance(value, int):
            return value.bit_length() // 3 + 1
        known = self._sizes.get(id(value))
        if known is not None:
            return known[1]
        parts: Iterator[Any]
        if isinstance(value, Namespace):  # its attributes change with {% set ns.x = ... %}: sized anew each time
            parts, keep = chain.from_iterable(object.__getattribute__(value, "_Namespace__attrs").items()), False
        elif isinstance(value, Mapping):
            parts, keep = chain.from_iterable(value.items()), True
        elif isinstance(value, Collection):
            parts, keep = iter(value), True
        else:
            return 16  # a number, none, a loop, a macro: a short repr
        if id(value) in self._open:
            return 8  # printed as {...}
        self._open.add(id(value))
        n = 2
        try:
            for part in parts:
                self.step()
                n += self.size(part) + 4  # quotes, comma and space
                if n > self.cap:
                    break
        finally:
            self._open.discard(id(value))
        if keep:
            self._sizes[id(value)] = (value, n)
        return n

    def counted(self, iterable: Iterable[Any], cost: int = 1) -> Iterator[Any]:
        for item in iterable:
            self.step(cost)
            yield item


BUDGET: ContextVar[Budget | None] = ContextVar("chat_template_budget", default=None)


def current() -> Budget:
    return BUDGET.get() or Budget()


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def widths(fmt: str | bytes, fields: Iterable[Any], braces: bool = False) -> int:
    """The widths and precisions a %-format ('%999999999s') or a str.format ('{:999999999}') pads its fields to.
    A width taken from the fields (`%*s`, `{:{}}`) counts as their largest integer."""
    fmt = fmt if isinstance(fmt, str) else fmt.decode("latin-1")
    if braces:
        try:
            specs = [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
        except ValueError:
            return 0  # the format fails on its own
        numbers = [n for spec in specs for n in re.findall(r"\d+|\{", spec)]
    else:
        numbers = [n for spec in _PERCENT_SPEC.findall(fmt) for n in spec if n]
    largest = max((abs(f) for f in fields if isinstance(f, int)), default=0)
    return sum(largest if n in ("*", "{") else int(n) if len(n) < 19 else 1 << 63 for n in numbers)


def call_bound(budget: Budget, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """How long the result of a method call can be, for the methods of str, bytes and int that make more than
    their input (padding, repeating, joining, formatting); 0 for the rest, which are checked after."""
    method = getattr(method, "__wrapped__", method)  # the sandbox wraps str.format
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}  # jinja's, dropped
    if isinstance(owner, int) and name == "to_bytes":
        return as_int(args[0] if args else kwargs.get("length", 1))
    if not isinstance(owner, str | bytes):
        return 0
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):
        return len(owner) + as_int(first)
    if name == "expandtabs":
        return len(owner) * max(1, as_int(args[0] if args else kwargs.get("tabsize", 8)))
    if name == "replace" and len(args) >= 2 and isinstance(args[1], str | bytes):
        old, new = args[0], args[1]
        return len(owner) + (owner.count(old) if old else len(owner) + 1) * len(new)
    if name == "join" and isinstance(first, Collection):
        return budget.size(first) + len(owner) * len(first)
    if name in ("format", "format_map"):
        fields = [*args, *kwargs.values(), *(first.values() if name == "format_map" and isinstance(first, Mapping)
                                             else ())]
        return len(owner) + budget.size(fields) + widths(owner, fields, braces=True)
    if name == "translate":
        return len(owner) * (1 + budget.size(first))
    return 0


def _filter_bound(budget: Budget, name: str, p: dict[str, Any]) -> int:
    """How long the result of jinja's filter `name` can be, from its arguments by name; 0 for the filters whose
    result is no larger than their input (checked after)."""
    size = budget.size
    if name == "center":
        return size(p["value"]) + as_int(p["width"])
    if name == "indent":
        width = p["width"]
        lines = p["s"].count("\n") + 1 if isinstance(p["s"], str) else size(p["s"])
        return size(p["s"]) + lines * (len(width) if isinstance(width, str) else as_int(width))
    if name == "batch":
        return as_int(p["linecount"])
    if name == "slice":
        return as_int(p["slices"])
    if name == "wordwrap":  # at worst a line per character
        return size(p["s"]) * (1 + size(p["wrapstring"] or "\n"))
    if name == "format":
        fields = [*p["args"], *p["kwargs"].values()]
        return size(p["value"]) + size(fields) + widths(str(p["value"]), fields)
    if name == "join":
        return size(p["value"]) + size(p["d"]) * len(p["value"])
    if name == "replace":
        s, old, new = p["s"], p["old"], p["new"]
        matches = s.count(old) if isinstance(s, str) and isinstance(old, str) and old else size(s) + 1
        return size(s) + matches * size(new)
    if name == "urlize":  # each link written twice, with its attributes
        return (size(p["value"]) + 1) * (64 + size(p["target"]) + size(p["rel"]))
    if name == "sum" and not isinstance(p["start"], int | float):  # lists added one by one: quadratic
        budget.build(len(p["iterable"]) * size(p["iterable"]))
    return 0


_SIZED_FILTERS = {"center", "indent", "batch", "slice", "wordwrap", "format", "join", "replace", "urlize", "sum"}


def bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """Filter `f`, refused past the bounds, its result paid for. (Lazy filters, map and select, hand on items of
    a checked container, so they stay within its size.)"""
    signature = inspect.signature(f)

    @functools.wraps(f)  # keeps jinja's pass_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.step()
        if name in _SIZED_FILTERS:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            p = bound.arguments
            for key in ("value", "iterable"):  # measured, so materialized: a generator runs once
                if name in ("join", "sum") and key in p and not isinstance(p[key], Collection):
                    p[key] = list(p[key])
            budget.fits(_filter_bound(budget, name, p))
            args, kwargs = bound.args, bound.kwargs
        return budget.made(f(*args, **kwargs))

    return bounded
