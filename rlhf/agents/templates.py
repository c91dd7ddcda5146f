"""Two chat templates with tool calling, in the two styles models ship today, for tiny models and
tests (a real model brings its own template in its tokenizer):

- ``CHATML_TOOLS``: ChatML as Qwen2.5/Hermes use it: tool signatures in the system turn, calls as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's text, results
  as ``<tool_response>`` blocks in one user turn per batch of consecutive tool messages.
- ``LLAMA3_TOOLS``: Llama 3.1 style: header tokens, ``<|eot_id|>`` ends a turn, results in the
  ``ipython`` role, contents trimmed.

No whitespace control (``{%-``): every newline is written out, so none is eaten by accident.
"""

from __future__ import annotations

__all__ = [
    "CHATML_SPECIAL",
    "CHATML_TOKENS",
    "CHATML_TOOL_TOKENS",
    "CHATML_TOOLS",
    "LLAMA3_TOKENS",
    "LLAMA3_TOOLS",
]

CHATML_SPECIAL = ["<|im_start|>", "<|im_end|>"]
# Single tokens that are not special (as in Qwen2.5): decoding a turn keeps them for the parser.
CHATML_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CHATML_TOKENS = CHATML_SPECIAL + CHATML_TOOL_TOKENS
CHATML_TOOLS = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}\n\n"
    "# Tools\n\nFunction signatures:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    'Call one with <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    "<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TOOLS = (
    "<|begin_of_text|>"
    "{% if tools %}"
    "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    'Call a function with a JSON object {"name": <function-name>, "parameters": <args>}.\n'
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}<|eot_id|>"
    "{% endif %}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
