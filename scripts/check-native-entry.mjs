// The program `npm run check:native` runs under valgrind (scripts/check-native.mjs starts it): the smallest engine
// equivalence check, on the built library (dist/). stories260K as one whole-model stage of the live executor
// (repacked buffer types allowed, weights mapped from the file, the few-row route for products of up to 8 rows);
// a few sequences each generate greedily alone, then the same sequences run together: one batched prefill of
// prompts of different lengths (a batched graph), then decode steps of all of them in one forwardBatch (a few-row
// product). Their tokens must agree. Exit 0: they do; exit 1: they do not, or the run failed.
//   node scripts/check-native-entry.mjs MODEL.gguf      (natively too, in ~1 s)
import { Effect } from "effect"
import { existsSync } from "node:fs"
import { greedy } from "../dist/services/Sampler.js"
import { StageExecutor } from "../dist/services/StageExecutor.js"
import * as StageExecutorLive from "../dist/layers/engine/StageExecutorLive.js"

const path = process.argv[2]
if (path === undefined || !existsSync(path)) {
  console.error(`check-native: no model at ${path} (usage: node scripts/check-native-entry.mjs stories260K.gguf)`)
  process.exit(1)
}

/** stories260K's 5 blocks in one stage; the loaded stage's facts are checked against it below. */
const BLOCKS = 5
/** Tokens each sequence generates. */
const N_TOKENS = 4
/** BOS (1) and a few token ids of stories260K's 512, three prompts of three lengths. */
const PROMPTS = [
  [1, 403, 407, 261, 378, 309],
  [1, 291, 345],
  [1, 365, 286, 430, 274, 299, 318, 264]
].map((p) => Int32Array.from(p))
const sessionOptions = { threads: 1, contextLength: 64 }

const tokensOf = (input) => ({ _tag: "Tokens", tokens: input })
const logitsOf = (output) => {
  if (output._tag !== "Logits") throw new Error(`a whole-model stage returned ${output._tag}, not Logits`)
  return output.logits
}

const maxAbsDiff = (a, b) => {
  let max = 0
  for (let i = 0; i < a.length; i++) max = Math.max(max, Math.abs(a[i] - b[i]))
  return max
}

const program = Effect.gen(function* () {
  const executor = yield* StageExecutor
  const stage = yield* executor.load({ path, layerStart: 0, layerEndExclusive: BLOCKS, isFirst: true, isLast: true })
  if (stage.info.numLayers !== BLOCKS) {
    return yield* Effect.dieMessage(`expected stories260K (${BLOCKS} blocks), ${path} has ${stage.info.numLayers}`)
  }

  // Alone: each sequence in its own session, a prefill then one decode step per token.
  const alone = []
  for (const prompt of PROMPTS) {
    const session = yield* executor.session(stage, sessionOptions)
    const tokens = []
    const logits = []
    let last = logitsOf(yield* session.forward(0, tokensOf(prompt)))
    let pos = prompt.length
    for (let i = 0; i < N_TOKENS; i++) {
      logits.push(last)
      const t = greedy(last)
      tokens.push(t)
      if (i + 1 < N_TOKENS) last = logitsOf(yield* session.forward(pos++, tokensOf(Int32Array.of(t))))
    }
    alone.push({ tokens, logits })
  }

  // Together: one session each, every step one forwardBatch of all of them.
  const sessions = []
  for (let i = 0; i < PROMPTS.length; i++) sessions.push(yield* executor.session(stage, sessionOptions))
  const together = PROMPTS.map(() => ({ tokens: [], logits: [] }))
  let outputs = yield* executor.forwardBatch(
    PROMPTS.map((prompt, i) => ({ session: sessions[i], startPos: 0, input: tokensOf(prompt) }))
  )
  for (let step = 0; step < N_TOKENS; step++) {
    const next = outputs.map((output, i) => {
      const logits = logitsOf(output)
      together[i].logits.push(logits)
      const t = greedy(logits)
      together[i].tokens.push(t)
      return t
    })
    if (step + 1 < N_TOKENS) {
      outputs = yield* executor.forwardBatch(
        next.map((t, i) => ({
          session: sessions[i],
          startPos: PROMPTS[i].length + step,
          input: tokensOf(Int32Array.of(t))
        }))
      )
    }
  }

  let mismatches = 0
  for (let i = 0; i < PROMPTS.length; i++) {
    const a = alone[i]
    const b = together[i]
    const same = a.tokens.every((t, k) => t === b.tokens[k])
    const diffs = a.logits.map((l, k) => maxAbsDiff(l, b.logits[k]).toExponential(1))
    console.log(
      `sequence ${i} (prompt of ${PROMPTS[i].length}): alone [${a.tokens}] together [${b.tokens}] ` +
        `${same ? "same" : "DIFFERENT"}; logits max |diff| per step ${diffs.join(" ")}`
    )
    if (!same) mismatches++
  }
  return mismatches
}).pipe(Effect.scoped, Effect.provide(StageExecutorLive.layerWith({ repack: true, mmap: true, smallBatchRows: 8 })))

Effect.runPromise(program).then(
  (mismatches) => {
    if (mismatches > 0) {
      console.error(`check-native: ${mismatches} of ${PROMPTS.length} sequences got other tokens batched than alone`)
      process.exit(1)
    }
    console.log(`check-native: ${PROMPTS.length} sequences x ${N_TOKENS} greedy tokens: batched = alone`)
  },
  (error) => {
    console.error("check-native: the run failed:", error)
    process.exit(1)
  }
)
