"""Which chat template a run renders with, said in words, and zoo's built-in templates as the Jinja that
transformers' apply_chat_template renders to the same text: written beside a model trained with one
(chat_template.jinja), so the export answers in the template it learned."""

from __future__ import annotations

from zoo.errors import ZooError
from zoo.io.chat import Tokenizer, builtin_bos, pick_template

# the built-in templates in Jinja, as the checkpoints they come from publish them (internlm2-chat-7b,
# Llama-2-7b-chat-hf, Meta-Llama-3-8B-Instruct): the same text as zoo.io.chat's BUILTIN
JINJA = {
    "internlm2": (
        "{{ bos_token }}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
        " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama-2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
        "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
        "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
        "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    "llama-3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
        "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"
    ),
}


def template_choice(tok: Tokenizer, template: str = "auto") -> str:
    """Which chat template `template` ("auto" or a name) renders with for `tok`, and why, in words: "internlm2
    (built-in ChatML: the tokenizer has no chat template of its own, and has <|im_start|>)"."""
    if template != "auto":
        return f"{template} (asked for)"
    name = pick_template(tok)
    if name == "checkpoint":
        return f"checkpoint (the tokenizer's own, from {tok.chat_template_file})"
    why = {"llama-3": "has <|start_header_id|>", "internlm2": "has <|im_start|>",
           "llama-2": "has neither <|im_start|> nor <|start_header_id|>"}[name]
    kind = {"internlm2": "ChatML", "llama-2": "[INST]", "llama-3": "Llama 3 headers"}[name]
    return f"{name} (built-in {kind}: the tokenizer has no chat template of its own, and {why})"


def builtin_jinja(template: str, tok: Tokenizer) -> str:
    """The built-in `template` as a Jinja chat template for `tok`: what transformers' apply_chat_template renders
    to the same text as zoo's (written beside a model trained with it, as chat_template.jinja)."""
    if template not in JINJA:
        raise ZooError(f"unknown built-in chat template {template!r}; choose one of {', '.join(JINJA)}")
    text = JINJA[template]
    if template == "internlm2" and builtin_bos(tok, "<|im_start|>") == "":
        text = text.removeprefix("{{ bos_token }}")
    return text
