"""A checkpoint's chat template is a program from whoever published it, and zoo runs it (even for `--prompt`, to
find the end-of-turn token). jinja2's immutable sandbox refuses escapes, not work: nested range loops hung,
`'a' * 10**10` allocated 10 GB, a recursive macro, a huge power and a non-UTF-8 chat_template.jinja gave
tracebacks. Now each fails within about a second with one line naming the file and the bound
(zoo.io.chat_template, zoo.io.template_budget), and real templates render as before (tests/test_chat_templates.py)."""

import shutil
import signal
import time

import pytest
import torch

import zoo
from recipes.data.tokenizer_choice import ASSETS
from zoo.generate.cli import main
from zoo.io.template_budget import REMEDY
from zoo.io.tokenizer import Tokenizer, render

CHAT = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]

HOSTILE = [  # (template, what the message names)
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "exceeded .* steps"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "exceeded .* steps"),
    ("{{ 'a' * 10**10 }}", r"exceeded \d+ characters in one string, list or output \(10000000000 asked for\)"),
    ("{{ [0] * 10**10 }}", "exceeded .* characters in one string, list or output"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "exceeded 64 nested calls"),
    ("{{ 2 ** 100000000 }}", "exceeded 65536-bit integers"),
    ("{{ (10 ** 4000) * (10 ** 4000) * (10 ** 4000) * (10 ** 4000) * (10 ** 4000) * (10 ** 4000) }}",
     "exceeded 65536-bit integers"),
    ("{{ range(10**12) | list }}", "exceeded 100000 items in a range"),
    ("{{ '%999999999s' | format(1) }}", "exceeded .* characters in one string"),
    ("{{ '{:999999999}'.format(1) }}", "exceeded .* characters in one string"),
    ("{{ 'x'.center(10**10) }}", "exceeded .* characters in one string"),
    ("{{ range(100000) | join('x' * 1000) }}", "exceeded .* characters in one string"),
    ("{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x }}",
     "exceeded .* characters"),
    ("{% set ns = namespace(x=[1, 2]) %}{% for i in range(40) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x }}",
     "exceeded .* characters"),
    ("{% for x in %}", "has a syntax error on line 1"),
]


def checkpoint_tokenizer(tmp_path, template: str | bytes):
    path = tmp_path / "tok"
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSETS / name, path / name)
    data = template.encode() if isinstance(template, str) else template
    (path / "chat_template.jinja").write_bytes(data)
    return path


@pytest.fixture
def deadline():
    """A hang fails the test after 60 s rather than blocking the suite (jinja loops are Python: SIGALRM reaches
    them)."""
    def alarm(signum, frame):
        raise TimeoutError("the chat template still renders after 60 s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("template, match", HOSTILE, ids=[t[:40] for t, _ in HOSTILE])
def test_a_hostile_template_fails_fast_in_one_line(tmp_path, deadline, template, match):
    d = checkpoint_tokenizer(tmp_path, template)
    tok = Tokenizer(d)
    start = time.process_time()
    with pytest.raises(zoo.ZooError, match=match) as e:
        render(CHAT, "checkpoint", tok)
    assert time.process_time() - start < 10  # the bounds stop it in about a second of CPU
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{d / 'chat_template.jinja'}: its chat template ")
    assert message.endswith(REMEDY)
    with pytest.raises(zoo.ZooError, match=match):  # the end-of-turn lookup raises it too, not "no end of turn"
        tok.stop_ids()


def test_a_template_that_is_not_utf8_is_named_with_its_byte(tmp_path):
    d = checkpoint_tokenizer(tmp_path, b"{{ 'caf\xe9' }}")
    with pytest.raises(zoo.ZooError, match=r"chat_template.jinja: the chat template is not UTF-8 text \(byte 7 is "
                                           r"0xe9\)"):
        Tokenizer(d)


def test_a_long_conversation_in_a_real_template_stays_within_the_bounds(tmp_path, deadline):
    """The bounds grow with the conversation: 2,000 turns of 1,000 characters each render in ChatML."""
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tok = Tokenizer(checkpoint_tokenizer(tmp_path, chatml))
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"{i:04d}" + "x" * 996} for i in range(2000)]
    chat = render(turns, "checkpoint", tok, add_generation_prompt=True)
    assert chat.text.count("<|im_start|>") == 2001 and chat.text.endswith("<|im_start|>assistant\n")
    # the spans take two renderings of the conversation up to each answer: quadratic, so checked on 200 turns
    short = render(turns[:200], "checkpoint", tok)
    assert [short.text[a:b] for a, b in short.spans] == [t["content"] + "<|im_end|>" for t in turns[1:200:2]]


def test_generate_with_a_hostile_template_is_one_line_and_exit_2(tmp_path, capsys, deadline):
    """Even `--prompt` renders the template (its end-of-turn token is a stop id): one line, exit code 2."""
    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    zoo.save(zoo.load("debug"), ckpt, tokenizer_from=ASSETS)
    (ckpt / "chat_template.jinja").write_text("{{ 'a' * 10**10 }}")
    assert main([str(ckpt), "--prompt", "Return the", "--device", "cpu", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {ckpt / 'chat_template.jinja'}: its chat template exceeded")
