"""Chat templates, rendered as transformers renders them but inside a locked-down Jinja sandbox.

A chat template comes from the model file, so it is untrusted code. Jinja's immutable sandbox
already refuses attributes that start with an underscore and methods that mutate; on top of it:

- Reaching for internals (`''.__class__`, `cycler.__init__.__globals__`,
  `self._TemplateReference__context`) is an error, not a silently empty string.
- Nothing may build a value over `MAX_ITEMS` characters or items in one step: `*`, `**` and `%`
  are checked before they run, as are the width of `center`/`indent`/`format`/`tojson`, string
  padding methods, `replace`, and `lipsum`; `range` is Jinja's (at most 100,000 items).
- Rendering (and compiling) gets `RENDER_SECONDS`: a trace hook checks the clock as the template's
  code runs, so loops nested to billions of steps or exponential macro recursion stop with an error.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum

MAX_ITEMS = 16 << 20  # characters or items one operation may produce (a RAG prompt is well under 1 M)
RENDER_SECONDS = 5.0  # a real template renders in milliseconds
_WIDE = re.compile(r"\d{7,}")  # a width or precision of a million or more in a format string
_PADDING = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "format", "format_map"})


def _refuse(what: str) -> SecurityError:
    return SecurityError(f"chat templates cannot {what}")


def _check_size(n: float, what: str) -> None:
    if n > MAX_ITEMS:
        raise _refuse(f"build {what} of {n:,.0f} items (at most {MAX_ITEMS:,})")


def _check_format(fmt: object) -> None:
    if isinstance(fmt, str) and _WIDE.search(fmt):
        raise _refuse("format with a width or precision of a million or more")


def _repeat_size(seq: object, times: object) -> float:
    return len(seq) * times if isinstance(seq, (str, list, tuple)) and isinstance(times, int) else 0


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%"})  # (intercepted operators are never constant-folded)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_size(max(_repeat_size(left, right), _repeat_size(right, left)), "a repeated sequence")
            if isinstance(left, int) and isinstance(right, int):
                _check_size((left.bit_length() + right.bit_length()) * 16, "a product")
        elif operator == "**":
            if isinstance(left, (int, float)) and isinstance(right, (int, float)) and abs(left) > 1 and right > 0:
                _check_size(right * math.log2(abs(left)) * 16, "a power")
        elif operator == "%":
            _check_format(left)
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if getattr(value, "__name__", "") in ("format", "format_map"):  # 'fmt'.format, checked at access
            _check_format(getattr(value, "__self__", None))
        return super().wrap_str_format(value)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise _refuse(f"access attribute {attribute!r} of a {type(obj).__name__} object")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's form)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name in _PADDING:
                _check_format(owner)
                _check_size(max((a for a in [*args, *kwargs.values()] if isinstance(a, int)), default=0), "a padded string")
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                _check_size(len(owner) + (owner.count(args[0]) if args[0] else len(owner) + 1) * len(args[1]),
                            "a replaced string")
        return super().call(__context, __obj, *args, **kwargs)


class _Namespace(Namespace):
    """`namespace()` that refuses underscore-prefixed attributes (as transformers' sandbox does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as Namespace
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise _refuse(f"set namespace attribute {name!r}")


class _Generation(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' filter: plain json.dumps, no HTML escaping (Jinja's own tojson escapes <, >, &, ').
    _check_size(indent if isinstance(indent, int) else len(str(indent or "")), "a json indent")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _capped_filter(env: jinja2.Environment, name: str, size: Callable[..., float]) -> None:
    original = env.filters[name]
    passes_context = hasattr(original, "jinja_pass_arg")  # e.g. replace takes the eval context first

    @functools.wraps(original)  # keeps jinja_pass_arg, so jinja passes what the original expects
    def capped(*args: Any, **kwargs: Any) -> Any:
        _check_size(size(*args[passes_context:], **kwargs), f"a `{name}` result")
        return original(*args, **kwargs)

    env.filters[name] = capped


def _width(value: Any, width: Any = 0, *rest: Any, **kw: Any) -> float:
    width = kw.get("width", width)
    return width * max(1, str(value).count("\n") + 1) if isinstance(width, int) else len(str(width))


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (jinja's names)
    _check_size(n * max, "lorem ipsum")
    return generate_lorem_ipsum(n, html, min, max)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    _capped_filter(env, "center", _width)
    _capped_filter(env, "indent", _width)
    _capped_filter(env, "format", lambda value, *a, **k: _check_format(value) or 0)
    _capped_filter(env, "replace", lambda s, old="", new="", count=None: (
        len(str(s)) + (str(s).count(str(old)) if old else len(str(s)) + 1) * len(str(new))))
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=lambda *a, **k: dict(*a, **k), lipsum=_lipsum)
    return env


def _bounded(fn: Callable[[], Any]) -> Any:
    """Run `fn` (compile or render) with the clock checked on every line of Python it runs."""
    deadline = time.monotonic() + RENDER_SECONDS
    steps = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal steps
        steps += 1
        if steps & 1023 == 0 and time.monotonic() > deadline:
            raise _refuse(f"run longer than {RENDER_SECONDS:g} s")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return fn()
    finally:
        sys.settrace(previous)


class ChatTemplate:
    """One compiled chat template. Whatever the sandbox refuses raises jinja2's SecurityError (a
    TemplateError); the template's own mistakes raise TemplateError, TypeError, ValueError and the like."""

    def __init__(self, source: str) -> None:
        self._template = _bounded(lambda: _environment().from_string(source))

    def render(self, **variables: Any) -> str:
        try:
            return _bounded(lambda: self._template.render(**variables))
        except MemoryError:
            raise _refuse("render: it ran out of memory") from None
