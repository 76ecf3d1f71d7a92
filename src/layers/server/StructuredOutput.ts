/**
 * Structured output for the OpenAI routes: `response_format` (`json_object`, `json_schema`), and llama-server's raw
 * `grammar` (GBNF) and `json_schema` fields, as the GBNF grammar the last stage samples under. A schema the
 * converter cannot honour, or a grammar llama.cpp would refuse, is a one-line reason naming the field.
 */
import { Effect, Schema } from "effect"
import type { SamplingOptions } from "../../services/Orchestrator.js"
import { gbnfProblem } from "../../services/Gbnf.js"
import { jsonObjectGrammar, jsonSchemaGrammar } from "./JsonGrammar.js"

export const ResponseFormat = Schema.Struct({
  type: Schema.Literal("text", "json_object", "json_schema"),
  json_schema: Schema.optional(
    Schema.NullOr(
      Schema.Struct({
        name: Schema.optional(Schema.String),
        description: Schema.optional(Schema.String),
        schema: Schema.optional(Schema.Unknown),
        strict: Schema.optional(Schema.NullOr(Schema.Boolean))
      })
    )
  ),
  // llama-server's form: {"type": "json_object", "schema": {...}}
  schema: Schema.optional(Schema.Unknown)
})

export const StructuredOutputFields = {
  response_format: Schema.optional(Schema.NullOr(ResponseFormat)),
  /** llama-server: a GBNF grammar the output must follow. */
  grammar: Schema.optional(Schema.NullOr(Schema.String)),
  /** llama-server: a JSON Schema the output must follow. */
  json_schema: Schema.optional(Schema.NullOr(Schema.Unknown))
}

type StructuredOutputBody = {
  readonly response_format?: typeof ResponseFormat.Type | null | undefined
  readonly grammar?: string | null | undefined
  readonly json_schema?: unknown
}

/** The grammar a request's output must follow (undefined: free text), or why the request cannot have one. */
export const structuredOutputGrammar = (
  body: StructuredOutputBody
): Effect.Effect<SamplingOptions["grammar"] | undefined, string> =>
  Effect.gen(function* () {
    const format = body.response_format ?? undefined
    const asked = [
      format !== undefined && format.type !== "text" ? "response_format" : undefined,
      body.grammar != null ? "grammar" : undefined,
      body.json_schema != null ? "json_schema" : undefined
    ].filter((field) => field !== undefined)
    if (asked.length > 1) return yield* Effect.fail(`${asked.join(" and ")} cannot be combined: give one`)
    if (body.grammar != null) {
      const problem = gbnfProblem(body.grammar)
      if (problem !== undefined) return yield* Effect.fail(`grammar: ${problem}`)
      return { text: body.grammar, root: "root" }
    }
    const fromSchema = (schema: unknown, path: string) =>
      jsonSchemaGrammar(schema, path).pipe(Effect.mapError((error) => error.message))
    if (body.json_schema != null) return yield* fromSchema(body.json_schema, "json_schema")
    if (format === undefined || format.type === "text") return undefined
    if (format.type === "json_object") {
      return format.schema === undefined
        ? yield* jsonObjectGrammar
        : yield* fromSchema(format.schema, "response_format.schema")
    }
    const schema = format.json_schema?.schema
    if (format.json_schema == null)
      return yield* Effect.fail("response_format.json_schema is required with type json_schema")
    if (schema === undefined) return yield* Effect.fail("response_format.json_schema.schema is required")
    return yield* fromSchema(schema, "response_format.json_schema.schema")
  })
