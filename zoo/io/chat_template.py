"""A checkpoint's chat template, rendered as transformers renders it (jinja2's immutable sandbox, its globals and
filters) but within bounds on the work and memory it may take.

A chat template is a program written by whoever published the checkpoint, and zoo runs it even just to find the
end-of-turn token. The immutable sandbox keeps it from reaching outside; the bounds here keep what it does inside
small, so that a hostile or broken template fails within about a second with one line (`ChatTemplateError`)
instead of hanging (nested loops) or allocating gigabytes ('a' * 10**10). A single C-level operation cannot be
interrupted, so the size of anything one operation could blow up (a repetition, a power, a format width, a join)
is computed before it is built. The bounds grow with the conversation and sit far above what real templates need
(Llama 3.x, Qwen2.5, Mistral, InternLM2 and Phi-3 take a few hundred steps per message and print their input
about once).
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.parser import Parser
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from zoo.errors import ZooError
from zoo.io.template_budget import (
    BUDGET,
    MAX_DEPTH,
    MAX_RANGE,
    MAX_TEMPLATE,
    REMEDY,
    Budget,
    ChatTemplateError,
    Exceeded,
    as_int,
    bits,
    bounded_filter,
    call_bound,
    current,
    widths,
)


class _Output:
    """The output of a rendering streamed so far (its length) and the `{% generation %}` blocks met: (where the
    output stood, the block's text)."""

    def __init__(self) -> None:
        self.length = 0
        self.blocks: list[tuple[int, str]] = []

    def stream(self, pieces: Iterable[str]) -> Iterator[str]:
        for piece in pieces:
            self.length += len(piece)
            yield piece


_OUTPUT: ContextVar[_Output | None] = ContextVar("chat_template_output", default=None)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # how transformers tells a template marks assistant text


def has_generation_blocks(template: str) -> bool:
    """Whether `template` marks assistant text with `{% generation %}` blocks."""
    return _GENERATION.search(template) is not None


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' marker of assistant text): rendered as its body, and
    noted with where the streamed output stood when it was printed."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        text = caller()
        output = _OUTPUT.get()
        if output is not None:
            output.blocks.append((output.length, text))
        return text


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; transformers replaces it with plain json.dumps. Encoded piece by
    # piece (the same text) so that a list holding one long string many times stops at the bound
    budget = current()
    if indent is not None:  # a piece is a newline and the indent times the nesting depth (at most Python's limit)
        budget.fits((len(indent) if isinstance(indent, str) else as_int(indent)) * sys.getrecursionlimit())
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return budget.join(encoder.iterencode(x))


def _strftime_now(fmt: str) -> str:
    # Llama 3.1/3.2 templates print "Today Date: ..." from this (a fixed date where it is not defined)
    current().fits(16 * len(fmt))  # a directive prints at most ~30 characters for its 2
    return datetime.now().strftime(fmt)


def _range(*args: int) -> range:
    """range() as jinja's sandbox bounds it, failing as the other bounds do."""
    items = range(*args)
    if items[MAX_RANGE:]:  # (len() overflows on range(10**30))
        raise Exceeded(f"exceeded {MAX_RANGE} items in a range")
    return items


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, with the bounds above on what a template does: the sandbox's hooks for
    operators and calls check sizes before anything is built, every filter is wrapped, and `_Hooks` routes loops,
    macro bodies, `~` and literals through `counted`, `pay`, `tilde` and `sized`. Nothing runs at compile time
    (no constant folding), so every check happens under the rendering's budget."""

    intercepted_binops = frozenset({"+", "-", "*", "**", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, optimized=False,
                         extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters = {name: bounded_filter(name, f) for name, f in self.filters.items()}
        del self.globals["lipsum"]  # its word count is unbounded; no chat template prints lorem ipsum
        self.globals.update(range=_range, raise_exception=_raise_exception, strftime_now=_strftime_now)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = current()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and abs(left) > 1 and right > 0:
            bits(left.bit_length() * right)
        elif operator == "*" and ints:
            bits(left.bit_length() + right.bit_length())
        elif operator == "*" and isinstance(left, int | str | bytes | list | tuple) and (
                isinstance(right, int) != isinstance(left, int)):
            seq, times = (right, left) if isinstance(left, int) else (left, right)
            budget.fits(budget.size(seq) * times)
        elif operator == "+" and isinstance(left, str | bytes | list | tuple):
            budget.fits(budget.size(left) + budget.size(right))
        elif operator == "%" and isinstance(left, str | bytes):
            fields = right if isinstance(right, tuple) else (right,)
            budget.fits(len(left) + budget.size(right) + widths(left, fields))
        return budget.made(self.binop_table[operator](left, right))

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.step()
        if isinstance(obj, LoopContext) and args:  # loop(children) in a recursive loop
            args = (budget.counted(args[0]), *args[1:])
        if getattr(obj, "__name__", "") == "join" and args and not isinstance(args[0], Collection):
            args = (list(args[0]), *args[1:])  # measured, so materialized
        budget.fits(call_bound(budget, obj, args, kwargs))
        budget.depth += 1
        try:
            if budget.depth > MAX_DEPTH:
                raise Exceeded(f"exceeded {MAX_DEPTH} nested calls (a macro calling itself without end?)")
            return budget.made(super().call(context, obj, *args, **kwargs))
        finally:
            budget.depth -= 1

    def concat(self, pieces: Iterable[str]) -> str:
        return current().join(pieces)

    # what the rewritten template calls (see _Hooks)
    def counted(self, iterable: Iterable[Any], cost: int) -> Iterator[Any]:
        return current().counted(iterable, cost)

    def pay(self, steps: int) -> None:
        current().step(steps)

    def tilde(self, *parts: Any) -> str:
        budget = current()
        budget.fits(sum(budget.size(p) for p in parts))
        return "".join(map(str, parts))

    def sized(self, value: Any) -> Any:
        budget = current()
        budget.fits(budget.size(value))
        return value


def _hook(name: str, *args: nodes.Node) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(name), cast(list[nodes.Expr], list(args)), [], None, None)


def _size(body: Sequence[nodes.Node | None]) -> int:
    """The nodes of a template's body: what one pass over it costs, in steps."""
    return sum(1 + sum(1 for _ in node.find_all(nodes.Node)) for node in body if node is not None)


class _Hooks(NodeTransformer):
    """Rewrites a parsed template so that what jinja runs inline, out of the sandbox's hooks, passes through
    `_BoundedEnvironment`: a loop counts its items and its body pays for its size on each pass, as does a macro's
    or call block's, and `~` and list, tuple and dict literals are sized (`[x, x]` doubles what x prints as)."""

    def _pays(self, node: nodes.For | nodes.Macro | nodes.CallBlock) -> nodes.Node:
        self.generic_visit(node)
        node.body.insert(0, nodes.ExprStmt(_hook("pay", nodes.Const(_size(node.body)))))
        return node

    def visit_For(self, node: nodes.For) -> nodes.Node:
        if node.recursive:  # its body also runs for the items of loop(children), counted by the call hook
            node.iter = _hook("counted", node.iter, nodes.Const(1))
            return self._pays(node)
        self.generic_visit(node)
        node.iter = _hook("counted", node.iter, nodes.Const(1 + _size(node.body) + _size([node.test])))
        return node

    visit_Macro = visit_CallBlock = _pays

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _hook("tilde", *node.nodes)

    def _sized(self, node: nodes.Expr) -> nodes.Node:
        self.generic_visit(node)
        return node if getattr(node, "ctx", "load") != "load" else _hook("sized", node)  # a tuple assigned to

    visit_List = visit_Tuple = visit_Dict = _sized


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedEnvironment()
    tree = _Hooks().visit(env.parse(template))
    tree.set_environment(env)
    tree.set_lineno(1)  # the nodes _Hooks added have none
    return env.from_string(tree)


def render_template(template: str, source: Path | None, variables: dict[str, Any],
                    generation: list[tuple[int, str]] | None = None) -> str:
    """`template` rendered with `variables` under the bounds; every failure is one line naming `source`.
    generation: a list to fill with its `{% generation %}` blocks: (where the output stood when the block was
    printed, the block's text). That is where the block's text starts when it is printed at the template's top
    level, as transformers assumes; from inside a macro or `{% set %}` block it may not be."""
    def fail(what: str) -> ChatTemplateError:
        return ChatTemplateError(f"{source}: its chat template {' '.join(what.split())}; {REMEDY}")

    if len(template) > MAX_TEMPLATE:
        raise fail(f"is {len(template)} characters, more than {MAX_TEMPLATE}")
    inputs = sum(len(repr(v)) for k, v in variables.items() if k in ("messages", "tools", "documents"))
    reset = BUDGET.set(Budget(input_chars=inputs))
    output = _Output()
    reset_output = _OUTPUT.set(output)
    try:
        # streamed, as transformers does to find generation blocks: a block printed at the top level of the
        # template starts where the output stands when it is evaluated
        compiled = _compile(template)
        text = current().join(output.stream(compiled.generate(**variables)))
        if generation is not None:
            generation += output.blocks
        return text
    except TemplateSyntaxError as e:
        raise fail(f"has a syntax error on line {e.lineno}: {e.message}") from e
    except (Exceeded, SecurityError) as e:
        raise fail(str(e)) from e
    except RecursionError as e:
        raise fail("exceeded Python's recursion limit") from e
    except MemoryError as e:
        raise fail("ran out of memory") from e
    except Exception as e:  # the template's own code failing (raise_exception, 1/0, a missing key)
        message = " ".join(f"{type(e).__name__}: {e}".split())  # TemplateError and kin name themselves
        raise ZooError(f"{source}: its chat template fails on this conversation: {message}") from e
    finally:
        _OUTPUT.reset(reset_output)
        BUDGET.reset(reset)
