/**
 * Chat templates a synthetic model can carry (`swactor synth --chat-template`), written for this project: Jinja as
 * llama.cpp and node-llama-cpp render it, with the special tokens the template needs (added to the synthetic
 * vocabulary; the end-of-turn token becomes its end-of-generation token).
 *
 * `chatml-tools`: ChatML with tools in the Hermes / Qwen style: the tools' JSON in the system turn, calls as
 * `<tool_call>{"name", "arguments"}</tool_call>` in the assistant's turn, results as `<tool_response>` in a user turn.
 */

export type SyntheticChatTemplate = "chatml-tools"

export const syntheticChatTemplates: ReadonlyArray<SyntheticChatTemplate> = ["chatml-tools"]

export interface SyntheticTemplateSpec {
  readonly template: string
  /** Special tokens the template writes: control tokens (never shown) and user-defined ones (shown as text). */
  readonly control: ReadonlyArray<string>
  readonly userDefined: ReadonlyArray<string>
  /** The token that ends the assistant's turn (written as the model's end-of-generation token). */
  readonly endOfTurn: string
}

const chatmlTools = `{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You can call functions. Each one's signature is a JSON object inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call a function, write its name and arguments as a JSON object inside <tool_call></tool_call> tags:
<tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}{% if call.function is defined %}{% set call = call.function %}{% endif %}<tool_call>
{"name": "{{ call.name }}", "arguments": {% if call.arguments is string %}{{ call.arguments }}{% else %}{{ call.arguments | tojson }}{% endif %}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ message.content }}
</tool_response>
{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}`

export const syntheticTemplateSpec = (name: SyntheticChatTemplate): SyntheticTemplateSpec => {
  switch (name) {
    case "chatml-tools":
      return {
        template: chatmlTools,
        control: ["<|im_start|>", "<|im_end|>"],
        userDefined: ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"],
        endOfTurn: "<|im_end|>"
      }
  }
}
