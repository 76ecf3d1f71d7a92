import { assert, describe, it } from "@effect/vitest"
import { makeStopMatcher } from "../../src/services/StopText.js"
import { makeLogprobAligner } from "../../src/services/TextLogprobs.js"

const entry = (token: string) => ({ token, logprob: -1, top: [] })

// Tokens through the stop matcher as ServerLive feeds them: what each released piece carries.
const run = (tokens: ReadonlyArray<string>, stops: ReadonlyArray<string>) => {
  const stop = makeStopMatcher(stops)
  const aligner = makeLogprobAligner()
  const out: Array<{ text: string; tokens: Array<string> }> = []
  for (const token of tokens) {
    aligner.add(entry(token), token.length)
    const match = stop.push(token)
    const entries = match.stopped ? aligner.stop(match.text.length) : aligner.release(match.text.length)
    if (match.text !== "" || entries.length > 0) out.push({ text: match.text, tokens: entries.map((e) => e.token) })
    if (match.stopped) return out
  }
  const rest = stop.flush()
  const entries = aligner.flush()
  if (rest !== "" || entries.length > 0) out.push({ text: rest, tokens: entries.map((e) => e.token) })
  return out
}

describe("TextLogprobs", () => {
  it("a token's entry goes out with the piece its text begins in", () => {
    assert.deepStrictEqual(run(["Once", " upon", " a"], []), [
      { text: "Once", tokens: ["Once"] },
      { text: " upon", tokens: [" upon"] },
      { text: " a", tokens: [" a"] }
    ])
  })

  it("text held back by a possible stop string keeps its entries until it is released", () => {
    // " T" might begin " The end": held; " tiger" shows it was not
    assert.deepStrictEqual(run(["Hi", " T", "iger"], [" The end"]), [
      { text: "Hi", tokens: ["Hi"] },
      { text: " Tiger", tokens: [" T", "iger"] }
    ])
  })

  it("a stop string drops the entries of the tokens that begin in or after it", () => {
    assert.deepStrictEqual(run(["Hi", " The", " e", "nd", " more"], [" The end"]), [{ text: "Hi", tokens: ["Hi"] }])
    // the stop begins inside a token: that token's text partly shows, so its entry stays; the next ones go
    assert.deepStrictEqual(run(["ab", "cX", "Y", "z"], ["XY"]), [
      { text: "ab", tokens: ["ab"] },
      { text: "c", tokens: ["cX"] }
    ])
  })

  it("tokens without text (a partial UTF-8 character) ride with the next text", () => {
    assert.deepStrictEqual(run(["a", "", "é"], []), [
      { text: "a", tokens: ["a"] },
      { text: "é", tokens: ["", "é"] }
    ])
  })
})
