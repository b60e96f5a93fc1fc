"""Chat templates come from model files: escapes and denial-of-service attempts end in a clear error."""

from __future__ import annotations

import time

import pytest

from conftest import tiny_tokenizer
from speculant.text import chat_template
from speculant.errors import SpeculantError

MESSAGES = [{"role": "user", "content": "hi"}]

ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ self._TemplateReference__context }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ [].__class__ }}",
    "{{ (1).__class__.__base__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ namespace(_x=1) }}",
    "{{ messages.append(1) }}",  # the immutable sandbox: no mutation of the caller's objects
    "{{ {}.update({'a': 1}) }}",
]

DOS = [
    "{% for i in range(10**10) %}x{% endfor %}",
    "{{ 'a' * 10**9 }}",
    "{{ [1] * 100000000 }}",
    "{{ 2 ** (10 ** 10) }}",
    "{{ 10 ** 100000000 }}",
    "{{ 'a'|center(2000000000) }}",
    "{{ 'a'|indent(2000000000, true) }}",
    "{{ 'a'.ljust(2000000000) }}",
    "{{ '%2000000000s' % 'a' }}",
    "{{ '{:>2000000000}'.format('a') }}",
    "{{ '%2000000000s'|format('a') }}",
    "{{ ('x' * 100000)|replace('x', 'y' * 100000) }}",
    "{{ lipsum(n=100000000) }}",
    "{{ messages|tojson(indent=2000000000) }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
]


def _render(template: str) -> str:
    tok = tiny_tokenizer(8)
    tok.chat_template = template
    return tok.apply_chat_template(MESSAGES)


@pytest.mark.parametrize("template", ESCAPES)
def test_escape_attempts_are_refused(template):
    with pytest.raises(SpeculantError, match="chat template failed: SecurityError"):
        _render(template)


@pytest.fixture
def short_deadline(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 1.0)


@pytest.mark.parametrize("template", DOS)
def test_denial_of_service_attempts_end_quickly_with_an_error(template, short_deadline):
    t0 = time.perf_counter()
    with pytest.raises(SpeculantError, match="chat template failed"):
        _render(template)
    assert time.perf_counter() - t0 < 10


def test_ordinary_templates_still_render():
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content|trim }}{{ '\\n' * 2 }}{% endfor %}"
                "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                "{{ ns.n }} {{ (messages|tojson(indent=2))|length > 0 }} {{ '%5s|' % 'a' }}{{ 'b'|center(5) }}"
                "{{ '-' * 3 }}{{ 2 ** 10 }}{{ 'x y'|replace(' ', '_') }}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert _render(template) == "<|user|>hi\n\n1 True     a|  b  ---1024x_y<|assistant|>"
