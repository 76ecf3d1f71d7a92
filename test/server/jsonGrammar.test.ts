import { assert, describe, it } from "@effect/vitest"
import { Effect, Either } from "effect"
import { jsonObjectGrammar, jsonSchemaGrammar } from "../../src/layers/server/JsonGrammar.js"

const refused = (schema: unknown, path = "schema") =>
  Effect.runPromise(Effect.either(jsonSchemaGrammar(schema, path))).then((r) => {
    assert.isTrue(Either.isLeft(r), `expected a refusal for ${JSON.stringify(schema)}`)
    return Either.isLeft(r) ? r.left.message : ""
  })
const grammar = (schema: unknown) => Effect.runPromise(jsonSchemaGrammar(schema)).then((g) => g.text)

describe("JsonGrammar", () => {
  it("converts an object schema with enum, array and nested object to GBNF with a root rule", async () => {
    const text = await grammar({
      type: "object",
      properties: {
        name: { type: "string", maxLength: 20 },
        mood: { enum: ["happy", "sad"] },
        tags: { type: "array", items: { type: "integer" }, maxItems: 3 },
        pet: { type: "object", properties: { kind: { const: "cat" } }, required: ["kind"] }
      },
      required: ["name", "mood"],
      additionalProperties: false
    })
    assert.match(text, /^root ::= /m)
    // the grammar ends with the JSON value (node-llama-cpp's trailing-newline tail is dropped)
    assert.notInclude(text.split("\n")[0]!, String.raw`"\n\n\n\n"`)
    assert.include(text, String.raw`"\"happy\""`)
    assert.include(text, String.raw`"\"cat\""`)
  })

  it("numbers: an integer has no exponent (1e-5 is no integer), a fraction's exponent is at most two digits (1e999 is Infinity)", async () => {
    const text = await grammar({
      type: "object",
      properties: { n: { type: "integer" }, x: { type: "number" } },
      required: ["n", "x"]
    })
    const rule = (name: string) => text.split("\n").find((line) => line.startsWith(`${name} ::= `)) ?? ""
    assert.notMatch(rule("integer-number-rule"), /\[eE\]/)
    assert.match(rule("integer-number-rule"), /\[1-9\] \[0-9\]/)
    assert.include(rule("fractional-number-rule"), "([eE] [-+]? [0-9]{1,2})?")
    assert.notMatch(rule("fractional-number-rule"), /\[eE\] [^)]*\{0,15\}/)
  })

  it("json_object admits any object", async () => {
    const { text } = await Effect.runPromise(jsonObjectGrammar)
    assert.match(text, /^root ::= "\{"/m)
  })

  it("supports $defs/definitions references, recursion included", async () => {
    const text = await grammar({
      $defs: {
        node: {
          type: "object",
          properties: { v: { type: "number" }, next: { anyOf: [{ $ref: "#/$defs/node" }, { type: "null" }] } }
        }
      },
      $ref: "#/$defs/node"
    })
    assert.match(text, /^root ::= /m)
    const zod = await grammar({
      definitions: { a: { type: "boolean" } },
      type: "object",
      properties: { x: { $ref: "#/definitions/a" } }
    })
    assert.match(zod, /true/)
  })

  it("refuses what the grammar cannot enforce, naming the schema path", async () => {
    const base = "response_format.json_schema.schema"
    assert.strictEqual(
      await refused({ type: "object", properties: { x: { type: "object", patternProperties: { "^a": {} } } } }, base),
      `${base}.properties.x: unsupported keyword "patternProperties"`
    )
    assert.strictEqual(await refused({ type: "integer", minimum: 3 }), `schema: unsupported keyword "minimum"`)
    assert.strictEqual(
      await refused({ type: "string", format: "email" }),
      `schema.format: unsupported format "email" (date-time, date and time are)`
    )
    assert.strictEqual(
      await refused({ type: "array", items: { pattern: "a+" } }),
      `schema.items: unsupported keyword "pattern"`
    )
    assert.strictEqual(await refused({ $ref: "#/$defs/missing" }), `schema.$ref: "#/$defs/missing" names no definition`)
    assert.strictEqual(
      await refused({ $ref: "http://example.com/s.json" }),
      `schema.$ref: unsupported reference "http://example.com/s.json" (only #/$defs/NAME or #/definitions/NAME)`
    )
    assert.strictEqual(
      await refused({ type: "object", properties: { a: { type: "string" } }, required: ["b"] }),
      `schema.required[0]: required property "b" is not in properties`
    )
    assert.strictEqual(await refused({ type: "wat" }), `schema.type: unknown type "wat"`)
    assert.strictEqual(
      await refused({ enum: [{ a: 1 }] }),
      `schema.enum[0]: only strings, numbers, booleans and null are supported`
    )
    assert.strictEqual(await refused("nope"), `schema: must be a JSON Schema object`)
    const huge = { enum: Array.from({ length: 20_000 }, (_, i) => `value ${i}`) }
    assert.match(await refused(huge), /^schema: is \d+ characters of JSON, over the 65536 a schema may have$/)
  })

  it("refuses a schema with no finite value (an object that must contain itself), naming the reference that closes the cycle", async () => {
    const base = "response_format.json_schema.schema"
    const endless = (path: string, name: string) =>
      `${path}: admits no finite value: every "${name}" must contain another "${name}", without end ` +
      `(every property is generated, required or not; end the recursion with anyOf [..., {"type": "null"}] or an ` +
      `array that may be empty)`
    const node = (child: unknown, required = true) => ({
      type: "object",
      properties: { name: { type: "string" }, child },
      ...(required ? { required: ["name", "child"] } : {})
    })
    // required, and (since the grammar generates every property) optional too
    for (const required of [true, false]) {
      assert.strictEqual(
        await refused({ $defs: { Node: node({ $ref: "#/$defs/Node" }, required) }, $ref: "#/$defs/Node" }, base),
        endless(`${base}.$defs.Node.properties.child`, "Node")
      )
    }
    // through another definition, below the root's own properties, under allOf and with definitions
    assert.strictEqual(
      await refused({
        type: "object",
        properties: { first: { $ref: "#/definitions/A" } },
        definitions: {
          A: { type: "object", properties: { b: { $ref: "#/definitions/B" } } },
          B: { allOf: [{ type: "object", properties: { a: { $ref: "#/definitions/A" } } }] }
        }
      }),
      endless("schema.$defs.B.allOf[0].properties.a", "A")
    )
    // a definition that is only itself, and an array that must hold one more of itself
    assert.strictEqual(
      await refused({ $defs: { Self: { $ref: "#/$defs/Self" } }, $ref: "#/$defs/Self" }),
      endless("schema.$defs.Self", "Self")
    )
    assert.strictEqual(
      await refused({
        $defs: { List: { type: "array", items: { $ref: "#/$defs/List" }, minItems: 1 } },
        $ref: "#/$defs/List"
      }),
      endless("schema.$defs.List.items", "List")
    )
    // every member of a choice endless: refused; one way out: accepted
    assert.strictEqual(
      await refused({
        $defs: { N: { anyOf: [node({ $ref: "#/$defs/N" }), { type: "array", prefixItems: [{ $ref: "#/$defs/N" }] }] } },
        $ref: "#/$defs/N"
      }),
      endless("schema.$defs.N.anyOf[0].properties.child", "N")
    )
    for (const way of [
      { anyOf: [{ $ref: "#/$defs/Node" }, { type: "null" }] },
      { $ref: "#/$defs/Node", nullable: true },
      { type: "array", items: { $ref: "#/$defs/Node" } },
      { type: "array", items: { $ref: "#/$defs/Node" }, minItems: 1, prefixItems: [{ type: "string" }] }
    ]) {
      const text = await grammar({ $defs: { Node: node(way) }, $ref: "#/$defs/Node" })
      assert.match(text, /^root ::= /m, JSON.stringify(way))
    }
  })
})
