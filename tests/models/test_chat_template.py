"""Chat-template rendering: the helpers templates rely on, and the sandbox."""

import datetime

import jinja2.exceptions
import pytest

from cadence.models.chat_template import ChatTemplateError, render_chat_template

USER = [{"role": "user", "content": "héllo <b>"}]


def test_variables_reach_the_template():
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}" \
               "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}{{ extra }}"
    text = render_chat_template(template, USER, bos_token="<s>", eos_token="</s>", extra="!")
    assert text == "<s>[user] héllo <b>></s>!"


def test_tojson_keeps_text_verbatim_and_takes_indent():
    tools = [{"name": "get_weather", "description": "Météo <now>"}]
    assert render_chat_template("{{ tools | tojson }}", [], tools=tools) == \
        '[{"name": "get_weather", "description": "Météo <now>"}]'
    assert render_chat_template("{{ tools[0] | tojson(indent=2) }}", [], tools=tools).startswith('{\n  "name"')


def test_raise_exception_stops_rendering():
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="system first"):
        render_chat_template(template, USER)


def test_strftime_now():
    assert render_chat_template("{{ strftime_now('%Y') }}", []) == str(datetime.date.today().year)


def test_blocks_are_trimmed_and_loop_controls_work():
    template = "{% for m in messages %}\n  {% if m.role == 'skip' %}{% continue %}{% endif %}\n{{ m.content }};\n{% endfor %}"
    messages = [{"role": "user", "content": "a"}, {"role": "skip", "content": "b"}, {"role": "user", "content": "c"}]
    assert render_chat_template(template, messages) == "a;\nc;\n"


def test_sandbox_forbids_mutation_and_internals():
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template("{{ messages.append(1) }}", USER)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template("{{ messages.__class__.__mro__ }}", USER)
