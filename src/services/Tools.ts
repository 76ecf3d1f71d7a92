/**
 * Tools (function calling) as plain data, independent of any wire format (OpenAI's, Anthropic's): the functions a chat
 * offers the model, the calls it made, and how the model's chat template writes a call (ToolSyntax). The functions that
 * render, parse and constrain calls are in src/layers/server/ToolCalls.ts.
 */

/** A function the model may call: `parameters` is a JSON schema of its arguments object (absent: no arguments). */
export interface ChatTool {
  readonly name: string
  readonly description?: string
  readonly parameters?: unknown
}

/** A call the model made: `arguments` is JSON text (an object). */
export interface ChatToolCall {
  readonly id: string
  readonly name: string
  readonly arguments: string
}

/**
 * Which calls the model may or must make: `auto` (text or calls, as it likes), `none` (no tools rendered, no calls),
 * `required` (at least one call), or the named function (exactly that one).
 */
export type ToolChoice = "auto" | "none" | "required" | { readonly name: string }

/** How a chat's tools are rendered and its calls constrained. */
export interface ChatToolOptions {
  readonly tools: ReadonlyArray<ChatTool>
  readonly choice: ToolChoice
  /** Whether the model may make several calls in one turn (default true). */
  readonly parallel?: boolean
}

/**
 * How the model writes calls, as text (special tokens as their text; a part that ends the turn, such as an
 * end-of-message token, cut off, since it never reaches the text):
 * - `Family`: the chat template's own syntax, as node-llama-cpp's chat wrapper describes it: each call is
 *   `callPrefix` name `paramsPrefix` arguments-JSON `callSuffix`; several calls sit between `sectionPrefix` and
 *   `sectionSuffix`, separated by `betweenCalls` (when `parallel`).
 * - `Generic`: a template without tools: the reply is one JSON object, `{"tool_call": {"name", "arguments"}}`
 *   (`{"tool_calls": [...]}` when `parallel`) or `{"response": "text"}`, as llama.cpp's server does.
 * - `MiniMaxM2`: MiniMax-M2's XML calls, `<minimax:tool_call><invoke name="NAME"><parameter name="ARG">VALUE`
 *   `</parameter>…</invoke>…</minimax:tool_call>`, each value typed by the tool's JSON schema (src/layers/server/MiniMaxM2.ts).
 * - `Glm`: GLM-4.5…4.7 and GLM-5's calls, `<tool_call>NAME<arg_key>ARG</arg_key><arg_value>VALUE</arg_value>…</tool_call>`,
 *   each value typed by the tool's JSON schema (src/layers/server/Glm.ts). `between`: what the template writes between
 *   the tags ("\n" for GLM-4.5/4.6, "" for 4.7/5); `thinkOpen`: the prompt left a `<think>` open (a forced call closes it
 *   first).
 */
export type ToolSyntax =
  | {
      readonly _tag: "Family"
      /** The chat wrapper's name (e.g. "Qwen", "Llama 3.1", "Mistral", "Harmony", "JinjaTemplate"). */
      readonly wrapper: string
      readonly callPrefix: string
      /** Other prefixes that also start a call (never written by the renderer). */
      readonly alternatePrefixes: ReadonlyArray<string>
      readonly paramsPrefix: string
      readonly callSuffix: string
      readonly parallel: boolean
      readonly sectionPrefix: string
      readonly betweenCalls: string
      readonly sectionSuffix: string
    }
  | { readonly _tag: "Generic"; readonly parallel: boolean }
  | { readonly _tag: "MiniMaxM2"; readonly parallel: boolean }
  | { readonly _tag: "Glm"; readonly parallel: boolean; readonly between: string; readonly thinkOpen: boolean }
