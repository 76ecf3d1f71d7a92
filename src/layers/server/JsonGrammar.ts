/**
 * JSON Schema → GBNF (llama.cpp's grammar format), for structured output (`response_format`) and tool-parameter
 * grammars. The grammar itself comes from node-llama-cpp's converter (`LlamaJsonSchemaGrammar`); this module first
 * translates a standard JSON Schema into the subset that converter understands and refuses, naming the schema path,
 * every keyword it would otherwise silently ignore (a grammar that let through output the schema forbids would be a
 * lie). What it accepts, every output the grammar admits validates against the schema:
 *
 * - `type` (one or several), `const`, `enum` (primitive values), `anyOf` / `oneOf`, `allOf` with one member,
 *   `nullable: true`, `$ref` to `#/$defs/…` or `#/definitions/…` (root-level definitions; recursion allowed where a
 *   value can end: a schema whose grammar admits no finite value, an object that must contain itself, is refused
 *   naming the reference that closes the cycle);
 * - objects: `properties`, `required` (every listed key must be a property; optional properties are always
 *   generated), `additionalProperties` (boolean or schema; absent = none generated), `minProperties`, `maxProperties`;
 * - arrays: `items` (a schema, or an array = tuple), `prefixItems`, `minItems`, `maxItems`;
 * - strings: `minLength`, `maxLength`, `format` of `date-time`, `date` or `time`;
 * - annotations (`title`, `description`, `default`, `examples`, `$schema`, `$id`, `$comment`, …) are ignored.
 *
 * node-llama-cpp is imported on first use (its import costs CPU time: bench/README.md); no model and no native code is
 * involved.
 */
import { Data, Effect } from "effect"

type GbnfJsonSchema = import("node-llama-cpp").GbnfJsonSchema

/** A schema the converter cannot honour: `path` is where (e.g. `response_format.json_schema.schema.properties.x`). */
export class JsonGrammarError extends Data.TaggedError("JsonGrammarError")<{
  readonly path: string
  readonly reason: string
}> {
  override get message(): string {
    return `${this.path}: ${this.reason}`
  }
}

/** The largest schema converted, in characters of its JSON (OpenAI's own limits are far below it). */
export const maxSchemaChars = 64 * 1024

/** A GBNF grammar and its start rule. */
export interface GbnfGrammar {
  readonly text: string
  readonly root: string
}

/** JSON Schema validation keywords the grammar cannot enforce: a schema using one is refused, not half-honoured. */
const unsupportedKeywords: ReadonlySet<string> = new Set([
  "pattern",
  "patternProperties",
  "propertyNames",
  "unevaluatedProperties",
  "unevaluatedItems",
  "dependentRequired",
  "dependentSchemas",
  "dependencies",
  "minimum",
  "maximum",
  "exclusiveMinimum",
  "exclusiveMaximum",
  "multipleOf",
  "uniqueItems",
  "contains",
  "minContains",
  "maxContains",
  "not",
  "if",
  "then",
  "else",
  "$dynamicRef",
  "$recursiveRef",
  "contentEncoding",
  "contentMediaType",
  "contentSchema"
])

/** A number bound no JSON number the grammar makes can pass anyway (zod's `.int()` sends the safe-integer range). */
const noBound = (key: string, bound: unknown) =>
  typeof bound === "number" &&
  ((key === "minimum" && bound <= Number.MIN_SAFE_INTEGER) || (key === "maximum" && bound >= Number.MAX_SAFE_INTEGER))

const primitiveTypes = ["string", "number", "integer", "boolean", "null"] as const
const allTypes: ReadonlyArray<string> = [...primitiveTypes, "object", "array"]
const formats: ReadonlySet<string> = new Set(["date-time", "date", "time"])

const isRecord = (value: unknown): value is Record<string, unknown> =>
  typeof value === "object" && value !== null && !Array.isArray(value)

const isPrimitive = (value: unknown): value is string | number | boolean | null =>
  value === null ||
  typeof value === "string" ||
  typeof value === "boolean" ||
  (typeof value === "number" && Number.isFinite(value))

const propertyPath = (path: string, key: string) =>
  /^[A-Za-z_$][A-Za-z0-9_$]*$/.test(key) ? `${path}.${key}` : `${path}[${JSON.stringify(key)}]`

class Refused {
  constructor(
    readonly path: string,
    readonly reason: string
  ) {}
}
const refuse = (path: string, reason: string): never => {
  throw new Refused(path, reason)
}

const count = (schema: Record<string, unknown>, key: string, path: string): number | undefined => {
  const value = schema[key]
  if (value === undefined) return undefined
  if (typeof value !== "number" || !Number.isInteger(value) || value < 0) {
    return refuse(`${path}.${key}`, "must be a non-negative integer")
  }
  return value
}

interface Translation {
  readonly defs: Map<string, GbnfJsonSchema>
  readonly rootDefs: Record<string, unknown>
  readonly rootPath: string
  /** The schema path each translated node came from (for refusals found after translating). */
  readonly paths: WeakMap<object, string>
}

const translate = (node: unknown, path: string, t: Translation): GbnfJsonSchema => {
  const translated = translateNode(node, path, t)
  if (translated !== anySchema && !t.paths.has(translated)) t.paths.set(translated, path)
  return translated
}

/** A `$ref` to a root definition, translated once (registered first, so a recursive reference finds it). */
const refSchema = (ref: unknown, path: string, t: Translation): GbnfJsonSchema => {
  const match = typeof ref === "string" ? /^#\/(\$defs|definitions)\/([^/]+)$/.exec(ref) : null
  if (match === null)
    return refuse(
      `${path}.$ref`,
      `unsupported reference ${JSON.stringify(ref)} (only #/$defs/NAME or #/definitions/NAME)`
    )
  const name = match[2]!.replaceAll("~1", "/").replaceAll("~0", "~")
  if (!t.defs.has(name)) {
    const target = t.rootDefs[name]
    if (target === undefined) return refuse(`${path}.$ref`, `${JSON.stringify(ref)} names no definition`)
    // Registered before translating, so a recursive reference finds it.
    t.defs.set(name, anySchema)
    t.defs.set(name, translate(target, `${t.rootPath}.$defs.${name}`, t))
  }
  return { $ref: `#/$defs/${name}` } as unknown as GbnfJsonSchema
}

/** The types a node admits: its declared ones, or those its keywords imply, else any. */
const typesOf = (node: Record<string, unknown>, path: string): ReadonlyArray<string> => {
  const declared = node["type"]
  let types: ReadonlyArray<string>
  if (declared === undefined) {
    types =
      node["properties"] !== undefined || node["additionalProperties"] !== undefined
        ? ["object"]
        : node["items"] !== undefined || node["prefixItems"] !== undefined
          ? ["array"]
          : allTypes
  } else {
    types = typeof declared === "string" ? [declared] : Array.isArray(declared) ? (declared as Array<string>) : []
    if (types.length === 0) return refuse(`${path}.type`, "must be a type name or a non-empty array of them")
    types.forEach((type) => {
      if (!allTypes.includes(type)) refuse(`${path}.type`, `unknown type ${JSON.stringify(type)}`)
    })
  }
  return types
}

const translateNode = (node: unknown, path: string, t: Translation): GbnfJsonSchema => {
  if (node === true) return anySchema
  if (node === false) return refuse(path, "schema false admits no value")
  if (!isRecord(node)) return refuse(path, "must be a JSON Schema object")
  for (const key of Object.keys(node)) {
    if (unsupportedKeywords.has(key) && !noBound(key, node[key])) refuse(path, `unsupported keyword "${key}"`)
  }
  if (node["allOf"] !== undefined) {
    const all = node["allOf"]
    if (!Array.isArray(all) || all.length !== 1)
      return refuse(path, `unsupported keyword "allOf" (only with one member)`)
    const { allOf: _, ...rest } = node
    return translate({ ...rest, ...(all[0] as object) }, `${path}.allOf[0]`, t)
  }
  if ((node["$defs"] !== undefined || node["definitions"] !== undefined) && path !== t.rootPath) {
    refuse(path, "definitions are supported at the schema's root only")
  }
  const nullable = node["nullable"] === true
  const withNull = (schema: GbnfJsonSchema): GbnfJsonSchema =>
    nullable ? { oneOf: [schema, { type: "null" }] } : schema

  if (node["$ref"] !== undefined) return withNull(refSchema(node["$ref"], path, t))
  if (node["const"] !== undefined) {
    const value = node["const"]
    if (!isPrimitive(value)) return refuse(`${path}.const`, "only a string, number, boolean or null is supported")
    return withNull({ const: value })
  }
  if (node["enum"] !== undefined) {
    const values = node["enum"]
    if (!Array.isArray(values) || values.length === 0) return refuse(`${path}.enum`, "must be a non-empty array")
    values.forEach((value, i) => {
      if (!isPrimitive(value)) refuse(`${path}.enum[${i}]`, "only strings, numbers, booleans and null are supported")
    })
    return withNull({ enum: values as Array<string | number | boolean | null> })
  }
  for (const key of ["anyOf", "oneOf"] as const) {
    if (node[key] === undefined) continue
    const members = node[key]
    if (!Array.isArray(members) || members.length === 0) return refuse(`${path}.${key}`, "must be a non-empty array")
    const { [key]: _, ...rest } = node
    const shared = Object.keys(rest).filter((k) => !annotation(k))
    if (shared.length > 0) return refuse(path, `unsupported keyword "${shared[0]}" beside "${key}"`)
    return withNull({ oneOf: members.map((member, i) => translate(member, `${path}.${key}[${i}]`, t)) })
  }
  let types = typesOf(node, path)
  if (nullable && !types.includes("null")) types = [...types, "null"]
  const members = types.map((type) => single(type, node, path, t))
  return members.length === 1 ? members[0]! : { oneOf: members }
}

const annotation = (key: string) =>
  [
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$defs",
    "definitions",
    "nullable"
  ].includes(key)

/** An object schema: its properties (all generated), additional properties, and bounds on their count. */
const objectSchema = (node: Record<string, unknown>, path: string, t: Translation): GbnfJsonSchema => {
  const properties = node["properties"] ?? {}
  if (!isRecord(properties)) return refuse(`${path}.properties`, "must be an object")
  const required = node["required"] ?? []
  if (!Array.isArray(required)) return refuse(`${path}.required`, "must be an array of property names")
  required.forEach((key, i) => {
    if (typeof key !== "string") refuse(`${path}.required[${i}]`, "must be a property name")
    else if (!(key in properties)) {
      refuse(`${path}.required[${i}]`, `required property ${JSON.stringify(key)} is not in properties`)
    }
  })
  const additional = node["additionalProperties"]
  const minProperties = count(node, "minProperties", path)
  const maxProperties = count(node, "maxProperties", path)
  const keys = Object.keys(properties)
  if (maxProperties !== undefined && maxProperties < keys.length) {
    refuse(`${path}.maxProperties`, `is below the ${keys.length} properties, which are always generated`)
  }
  return {
    type: "object",
    properties: Object.fromEntries(
      keys.map((key) => [key, translate(properties[key], propertyPath(`${path}.properties`, key), t)])
    ),
    ...(additional === true || (isRecord(additional) && Object.keys(additional).length === 0)
      ? { additionalProperties: true }
      : isRecord(additional)
        ? { additionalProperties: translate(additional, `${path}.additionalProperties`, t) }
        : {}),
    ...(minProperties !== undefined ? { minProperties } : {}),
    ...(maxProperties !== undefined ? { maxProperties } : {})
  } as GbnfJsonSchema
}

/** An array schema: its items, its prefix items (or an items array), and bounds on its length. */
const arraySchema = (node: Record<string, unknown>, path: string, t: Translation): GbnfJsonSchema => {
  let items = node["items"]
  let prefix = node["prefixItems"]
  if (Array.isArray(items)) {
    if (prefix !== undefined) return refuse(`${path}.items`, "an items array beside prefixItems")
    prefix = items
    items = node["additionalItems"] ?? true
  } else if (node["additionalItems"] !== undefined) {
    return refuse(path, `unsupported keyword "additionalItems" without an items array`)
  }
  if (prefix !== undefined && !Array.isArray(prefix))
    return refuse(`${path}.prefixItems`, "must be an array of schemas")
  if (items === false && prefix === undefined) return refuse(`${path}.items`, "items false admits only the empty array")
  const minItems = count(node, "minItems", path)
  const maxItems = count(node, "maxItems", path)
  if (minItems !== undefined && maxItems !== undefined && maxItems < minItems) {
    refuse(`${path}.maxItems`, "is below minItems")
  }
  const prefixItems = (prefix as Array<unknown> | undefined)?.map((member, i) =>
    translate(member, `${path}.prefixItems[${i}]`, t)
  )
  if (prefixItems !== undefined && maxItems !== undefined && maxItems < prefixItems.length) {
    refuse(`${path}.maxItems`, "is below the number of prefixItems")
  }
  return {
    type: "array",
    ...(items !== undefined && items !== true && items !== false
      ? { items: translate(items, `${path}.items`, t) }
      : {}),
    ...(prefixItems !== undefined ? { prefixItems } : {}),
    ...(items === false && prefixItems !== undefined ? { maxItems: prefixItems.length } : {}),
    ...(minItems !== undefined ? { minItems } : {}),
    ...(maxItems !== undefined ? { maxItems } : {})
  } as GbnfJsonSchema
}

/** A string schema: a supported format, or bounds on its length. */
const stringSchema = (node: Record<string, unknown>, path: string): GbnfJsonSchema => {
  const format = node["format"]
  const minLength = count(node, "minLength", path)
  const maxLength = count(node, "maxLength", path)
  if (format !== undefined) {
    if (typeof format !== "string" || !formats.has(format)) {
      return refuse(`${path}.format`, `unsupported format ${JSON.stringify(format)} (date-time, date and time are)`)
    }
    if (minLength !== undefined || maxLength !== undefined) {
      return refuse(path, "minLength/maxLength beside a format")
    }
    return { type: "string", format } as GbnfJsonSchema
  }
  if (minLength !== undefined && maxLength !== undefined && maxLength < minLength) {
    return refuse(`${path}.maxLength`, "is below minLength")
  }
  return {
    type: "string",
    ...(minLength !== undefined ? { minLength } : {}),
    ...(maxLength !== undefined ? { maxLength } : {})
  }
}

const single = (type: string, node: Record<string, unknown>, path: string, t: Translation): GbnfJsonSchema => {
  switch (type) {
    case "object":
      return objectSchema(node, path, t)
    case "array":
      return arraySchema(node, path, t)
    case "string":
      return stringSchema(node, path)
    default:
      return { type: type as (typeof primitiveTypes)[number] }
  }
}

/** Any JSON value. */
const anySchema: GbnfJsonSchema = {
  oneOf: [
    { type: ["string", "number", "boolean", "null"] },
    { type: "object", additionalProperties: true },
    { type: "array" }
  ]
}

/** The definition a translated `$ref` names (`#/$defs/NAME`). */
const refName = (ref: string) => ref.slice("#/$defs/".length)

/**
 * Whether the grammar admits a value of finite length for `schema`, given the definitions that do (`finiteDefs`). The
 * grammar generates every property, required or not, and every prefix item, and the items `minItems` asks for.
 */
const admitsFinite = (schema: GbnfJsonSchema, finiteDefs: ReadonlySet<string>): boolean => {
  const node = schema as Record<string, unknown>
  if (typeof node["$ref"] === "string") return finiteDefs.has(refName(node["$ref"]))
  if (Array.isArray(node["oneOf"]))
    return (node["oneOf"] as Array<GbnfJsonSchema>).some((m) => admitsFinite(m, finiteDefs))
  return mustHold(node).every((inner) => admitsFinite(inner, finiteDefs))
}

/** The schemas every value of an object or array `node` holds a value of (none for other types). */
const mustHold = (node: Record<string, unknown>): ReadonlyArray<GbnfJsonSchema> => {
  if (node["type"] === "object") {
    const properties = Object.values((node["properties"] ?? {}) as Record<string, GbnfJsonSchema>)
    const additional = node["additionalProperties"]
    const extra = ((node["minProperties"] as number | undefined) ?? 0) > properties.length
    return extra && isRecord(additional) ? [...properties, additional as GbnfJsonSchema] : properties
  }
  if (node["type"] === "array") {
    const prefix = (node["prefixItems"] ?? []) as Array<GbnfJsonSchema>
    const items = node["items"]
    const extra = ((node["minItems"] as number | undefined) ?? 0) > prefix.length
    return extra && isRecord(items) ? [...prefix, items as GbnfJsonSchema] : prefix
  }
  return []
}

/**
 * Refuses a schema whose grammar admits no finite value (an object that must contain itself, directly or through
 * other definitions): sampling under it could only end at max_tokens, with truncated JSON. The definitions that admit
 * a finite value are found as a least fixed point; the refusal names the reference that closes the cycle.
 */
const refuseEndless = (root: GbnfJsonSchema, t: Translation): void => {
  const finiteDefs = new Set<string>()
  for (let grew = true; grew;) {
    grew = false
    for (const [name, schema] of t.defs) {
      if (!finiteDefs.has(name) && admitsFinite(schema, finiteDefs)) {
        finiteDefs.add(name)
        grew = true
      }
    }
  }
  if (admitsFinite(root, finiteDefs)) return
  // Walk down what every value must hold, never finite, until a definition comes round again.
  const entered = new Set<string>()
  let at = root
  for (;;) {
    const node = at as Record<string, unknown>
    if (typeof node["$ref"] === "string") {
      const name = refName(node["$ref"])
      if (entered.has(name)) {
        return refuse(
          t.paths.get(at) ?? t.rootPath,
          `admits no finite value: every "${name}" must contain another "${name}", without end ` +
            `(every property is generated, required or not; end the recursion with anyOf [..., {"type": "null"}] ` +
            `or an array that may be empty)`
        )
      }
      entered.add(name)
      at = t.defs.get(name)!
      continue
    }
    const next = Array.isArray(node["oneOf"])
      ? (node["oneOf"] as Array<GbnfJsonSchema>)[0]
      : mustHold(node).find((inner) => !admitsFinite(inner, finiteDefs))
    if (next === undefined) return refuse(t.paths.get(at) ?? t.rootPath, "admits no finite value")
    at = next
  }
}

/** The node-llama-cpp subset a JSON Schema translates to, or the first thing in it the grammar cannot honour. */
export const toConverterSchema = (schema: unknown, path: string): GbnfJsonSchema | JsonGrammarError => {
  try {
    const rootDefs = isRecord(schema)
      ? { ...asRecord(schema["definitions"], `${path}.definitions`), ...asRecord(schema["$defs"], `${path}.$defs`) }
      : {}
    const t: Translation = { defs: new Map(), rootDefs, rootPath: path, paths: new WeakMap() }
    const root = translate(schema, path, t)
    if (t.defs.size === 0) return root
    refuseEndless(root, t)
    const $defs = Object.fromEntries(t.defs)
    return isRecord(root) && (root as Record<string, unknown>)["$ref"] === undefined
      ? ({ ...root, $defs } as GbnfJsonSchema)
      : ({ oneOf: [root], $defs } as GbnfJsonSchema)
  } catch (error) {
    if (error instanceof Refused) return new JsonGrammarError({ path: error.path, reason: error.reason })
    throw error
  }
}

const asRecord = (value: unknown, path: string): Record<string, unknown> => {
  if (value === undefined) return {}
  if (!isRecord(value)) return refuse(path, "must be an object of schemas")
  return value
}

type NodeLlamaCpp = typeof import("node-llama-cpp")
let library: Promise<NodeLlamaCpp> | undefined

/**
 * node-llama-cpp's converter, without a Llama: `LlamaJsonSchemaGrammar` turns the schema into GBNF in TypeScript and
 * hands the text to the native grammar class it finds on the llama object, which this stand-in replaces with a no-op
 * (no binary is loaded; the text is checked by Gbnf.ts's parser where it matters).
 */
const convert = (lib: NodeLlamaCpp, schema: GbnfJsonSchema): string => {
  const noNative = { _bindings: { AddonGrammar: class {} } } as unknown as ConstructorParameters<
    NodeLlamaCpp["LlamaJsonSchemaGrammar"]
  >[0]
  const text = new lib.LlamaJsonSchemaGrammar(noNative, schema as never).grammar
  // node-llama-cpp ends the root with four or more newlines, which it watches for to stop; here the grammar ends with
  // the JSON value, so the sampler can only end the generation there.
  const ended = text.replace(/^(root ::= .*) "\\n\\n\\n\\n" \[\\n\]\*$/m, "$1")
  // Its number rules allow any exponent: `1e-5` for an integer is no integer, and `1e999` parses as Infinity. An integer
  // here has no exponent, a fraction's exponent at most two digits (every value it admits is a finite JSON number).
  return ended
    .replace(/^(integer-number-rule ::= .*?) \(\[eE\] .*\)\?$/m, "$1")
    .replace(/^(fractional-number-rule ::= .*?) \(\[eE\] .*\)\?$/m, "$1 ([eE] [-+]? [0-9]{1,2})?")
}

/**
 * The GBNF grammar for a JSON Schema (root rule `root`), or a `JsonGrammarError` naming the schema path it cannot
 * honour. `path` prefixes error paths (e.g. `response_format.json_schema.schema`; default `schema`).
 */
export const jsonSchemaGrammar = (schema: unknown, path = "schema"): Effect.Effect<GbnfGrammar, JsonGrammarError> =>
  Effect.gen(function* () {
    // The conversion runs on the caller's thread, its time growing with the schema (bench/README.md): hence the bound.
    const size = JSON.stringify(schema)?.length ?? 0
    if (size > maxSchemaChars) {
      return yield* new JsonGrammarError({
        path,
        reason: `is ${size} characters of JSON, over the ${maxSchemaChars} a schema may have`
      })
    }
    const converted = toConverterSchema(schema, path)
    if (converted instanceof JsonGrammarError) return yield* converted
    const lib = yield* Effect.promise(() => (library ??= import("node-llama-cpp")))
    return yield* Effect.try({
      try: () => ({ text: convert(lib, converted), root: "root" }),
      catch: (cause) => new JsonGrammarError({ path, reason: cause instanceof Error ? cause.message : String(cause) })
    })
  })

/** `response_format: {type: "json_object"}`: any JSON object. */
export const jsonObjectGrammar: Effect.Effect<GbnfGrammar> = Effect.orDie(
  jsonSchemaGrammar({ type: "object", additionalProperties: true })
)
