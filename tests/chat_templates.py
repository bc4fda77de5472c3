"""Chat templates of two model families that call tools in the Hermes format, written here from the formats their
published templates render (Qwen2.5-Instruct's and Qwen3's tokenizer_config.json, 2024-2025), and one of Llama 3.1's
JSON calls (LLAMA31, its own paragraph below), for the tests of
grpo_tools' native tool calls: they render with SmolLM2's tokenizer, whose <|im_start|> and <|im_end|> are the same
special tokens. What the tests rely on, as the published templates do:
- with tools: a system turn (the given system message, or the family's default for Qwen2.5) followed by "# Tools" and
  each tool's JSON schema in <tools></tools>, and how to call one (<tool_call> JSON);
- an assistant turn's calls: each `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, after a newline
  when text or another call comes before it;
- consecutive tool messages: one user turn of `\\n<tool_response>\\n...\\n</tool_response>` blocks;
- Qwen3 alone: an assistant turn after the last real user query shows its reasoning as `<think>\\n...\\n</think>\\n\\n`
  when it is the last message or has reasoning, and the generation prompt with enable_thinking false is followed by
  an empty `<think>\\n\\n</think>\\n\\n`; earlier assistant turns lose theirs (the case where rendering a conversation
  again changes its earlier turns).
QWEN3_THINKING, Qwen3-Thinking-2507's: QWEN3 whose generation prompt opens the reasoning, `<think>\\n`.
LLAMA31, from Llama-3.1-Instruct's template with custom tools (tools_in_user_message, its default): the tools' JSON
schemas and how to call them open the first user turn; an assistant turn's call is the turn itself, `{"name": ...,
"parameters": ...}` (one call a turn); a tool message is an `ipython` turn. Its headers are text here and its
<|eot_id|> is SmolLM2's <|im_end|>, so that it renders with SmolLM2's tokenizer; the system turn of dates is left
out."""

TOOLS_SECTION = """\
{%- macro tools_section(tools) -%}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with \
function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n\
</tool_call>' -}}
{%- endmacro -%}
{%- macro calls(message, content) -%}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function or call -%}
{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' -}}
{{- call.arguments if call.arguments is string else (call.arguments | tojson) -}}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{%- endmacro -%}
{%- macro tool_turn(messages, loop) -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + messages[loop.index0].content + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- endmacro -%}
"""

QWEN25 = (
    TOOLS_SECTION
    + """\
{%- set first_system = messages[0].role == 'system' -%}
{%- set default = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' + (messages[0].content if first_system else default) + '\\n\\n' -}}
{{- tools_section(tools) + '<|im_end|>\\n' -}}
{%- elif not first_system -%}
{{- '<|im_start|>system\\n' + default + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' or (message.role == 'system' and not (loop.first and tools)) -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}
{%- if not message.tool_calls and not message.content -%}{{- '\\n' -}}{%- endif -%}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function or call -%}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' -}}
{{- call.arguments if call.arguments is string else (call.arguments | tojson) -}}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{{- tool_turn(messages, loop) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""
)

QWEN3 = (
    TOOLS_SECTION
    + """\
{%- set first_system = messages[0].role == 'system' -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' + (messages[0].content + '\\n\\n' if first_system else '') -}}
{{- tools_section(tools) + '<|im_end|>\\n' -}}
{%- elif first_system -%}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=messages | length - 1, found=false) -%}
{%- for message in messages[::-1] -%}
{%- set index = messages | length - 1 - loop.index0 -%}
{%- if not ns.found and message.role == 'user' and not (message.content.startswith('<tool_response>') and \
message.content.endswith('</tool_response>')) -%}
{%- set ns.found = true -%}{%- set ns.last_query = index -%}
{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- set content = message.content if message.content is string else '' -%}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
{%- if not reasoning and '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}
{%- else -%}
{{- '<|im_start|>assistant\\n' + content -}}
{%- endif -%}
{{- calls(message, content) -}}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{{- tool_turn(messages, loop) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}"""
)

LLAMA31 = """\
{%- set ns = namespace(tools_shown=not tools) -%}
{%- for message in messages -%}
{{- '<|start_header_id|>' + ('ipython' if message.role == 'tool' else message.role) + '<|end_header_id|>\\n\\n' -}}
{%- if message.role == 'user' and not ns.tools_shown -%}
{%- set ns.tools_shown = true -%}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that \
best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": dictionary of \
argument name and its value}.Do not use variables.\\n\\n' -}}
{%- for tool in tools -%}{{- (tool | tojson(indent=4)) + '\\n\\n' -}}{%- endfor -%}
{%- endif -%}
{%- if message.tool_calls -%}
{%- set call = message.tool_calls[0].function -%}
{{- '{"name": "' + call.name + '", "parameters": ' + (call.arguments | tojson) + '}' -}}
{%- else -%}
{{- message.content -}}
{%- endif -%}
{{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"""

QWEN3_THINKING = QWEN3.replace(
    "{{- '<|im_start|>assistant\\n' -}}\n{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}",
    "{{- '<|im_start|>assistant\\n<think>\\n' -}}",
)
assert QWEN3_THINKING != QWEN3
