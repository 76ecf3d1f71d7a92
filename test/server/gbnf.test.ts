import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { gbnfProblem } from "../../src/services/Gbnf.js"
import { jsonObjectGrammar, jsonSchemaGrammar } from "../../src/layers/server/JsonGrammar.js"

describe("Gbnf", () => {
  it("accepts llama.cpp's syntax", () => {
    const grammar = String.raw`# a comment
root ::= greeting (" " name)? [.!]{1,3}
greeting ::= "hi" | "hello" | "\x41\u00e9\t"
name ::= [A-Za-z] [a-z\-]* ( "-" [a-z]+
  )?
any ::= .
`
    assert.strictEqual(gbnfProblem(grammar), undefined)
    assert.strictEqual(gbnfProblem(`start ::= "a"`, "start"), undefined)
  })

  it("accepts the grammars JsonGrammar makes", async () => {
    const { text } = await Effect.runPromise(jsonObjectGrammar)
    assert.strictEqual(gbnfProblem(text), undefined)
    const schema = await Effect.runPromise(
      jsonSchemaGrammar({
        type: "object",
        properties: {
          a: { type: "array", items: { enum: ["x", 1, null] }, minItems: 1, maxItems: 4 },
          b: { type: "string", format: "date" }
        }
      })
    )
    assert.strictEqual(gbnfProblem(schema.text), undefined)
  })

  it("refuses what llama.cpp refuses or chokes on, saying where", () => {
    assert.strictEqual(gbnfProblem(`root ::= foo`), "undefined rule foo at line 1, column 10")
    assert.strictEqual(gbnfProblem(`x ::= "a"`), "no rule named root (the root rule)")
    assert.strictEqual(gbnfProblem(``), "no rule named root (the root rule)")
    assert.strictEqual(gbnfProblem(`root ::= [a-`), "unexpected end of input at line 1, column 13")
    assert.strictEqual(gbnfProblem(`root ::= "\\q"`), `unknown escape "\\q" at line 1, column 11`)
    assert.strictEqual(gbnfProblem(`root ::= ( "a"`), "expected ) at line 1, column 15")
    // llama.cpp's parser allocates without end on this one (a process killed for memory).
    assert.strictEqual(
      gbnfProblem(`root ::= "a"{3,1}`),
      "repetition {3,1} has its maximum below its minimum at line 1, column 18"
    )
    assert.strictEqual(gbnfProblem(`root ::= "a"{5000}`), "a repetition count above 1000 at line 1, column 19")
    assert.match(gbnfProblem(`root ::= ("a"{1000}){1000}`) ?? "", /expands to over 200000 symbols/)
    assert.strictEqual(
      gbnfProblem(`root ::= root "a"`),
      "left recursion through rule root (llama.cpp does not support it)"
    )
    assert.strictEqual(
      gbnfProblem(`root ::= x\nx ::= "b"? y\ny ::= x "a"`),
      "left recursion through rule x (llama.cpp does not support it)"
    )
    assert.strictEqual(gbnfProblem(`root ::= <think>`), "token references (<…>) are not supported at line 1, column 10")
    assert.match(gbnfProblem(`root ::= ${"(".repeat(100)}"a"${")".repeat(100)}`) ?? "", /groups nest deeper than 64/)
    assert.match(gbnfProblem(`root ::= "a" )`) ?? "", /expected the end of rule root/)
  })
})
