/**
 * Speculative steps on recurrent blocks (qwen35's DeltaNet, Kimi K3's KDA): a verify step of a token and its drafts
 * advances the blocks' states through every row, and the next step may start after any of its rows (the drafts the
 * last stage kept). The states then must be that row's, which a verify step keeps per row (RecurrentSnapshots.ts).
 * Against sessions that decode the kept rows one by one, every later step's logits are bitwise equal: with every
 * draft refused, some kept, all kept, and a second verify step rolled back after a first. The few-row route is forced
 * (smallBatchRows 7 and 0) so no measurement picks the path.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { join } from "node:path"
import type { StageOutput } from "../../src/domain/engine.js"
import * as StageExecutorLive from "../../src/layers/engine/StageExecutorLive.js"
import { readModelHParams } from "../../src/layers/engine/StageLayout.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { type SyntheticModelOptions, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { type LoadedStage, type StageSession, StageExecutor } from "../../src/services/StageExecutor.js"
import { writeConverted } from "../support/convertedModels.js"
import { modelFolder } from "../support/synthFiles.js"

const dir = modelFolder("swactor-recurrent-rollback-")

const qwen35 = (type: "f32" | "q8_0"): SyntheticModelOptions => ({
  path: join(dir, `qwen35-${type}.gguf`),
  arch: "qwen35",
  layers: 8,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 2,
  headDim: 64,
  vocab: 400,
  contextLength: 256,
  type,
  seed: 43
})

const prompt = Int32Array.from([1, 303, 261, 378, 300, 270, 271, 307, 329, 282])
const first = Int32Array.from([309, 267, 272, 314, 285, 301])
const second = Int32Array.from([290, 277, 266, 299])

/** One step through every stage (hidden rows passed on): the last stage's output. */
const step = (sessions: ReadonlyArray<StageSession>, start: number, tokens: Int32Array, verify: boolean) =>
  Effect.gen(function* () {
    let out: StageOutput = yield* sessions[0]!.forward(start, { _tag: "Tokens", tokens, ...(verify ? { verify } : {}) })
    for (const s of sessions.slice(1)) {
      if (out._tag !== "Hidden") return assert.fail("a stage before the last gave logits")
      out = yield* s.forward(start, {
        _tag: "Hidden",
        hidden: out.hidden,
        nTokens: out.nTokens,
        ...(verify ? { verify } : {})
      })
    }
    if (out._tag !== "Logits") return assert.fail("the last stage gave no logits")
    return out.logits
  })

/** Logits of decoding `tokens` one by one from `start` on. */
const oneByOne = (sessions: ReadonlyArray<StageSession>, start: number, tokens: Int32Array) =>
  Effect.forEach(Array.from(tokens), (t, i) => step(sessions, start + i, Int32Array.of(t), false))

/**
 * A verify step of `rows` at `start` keeping `kept` drafts, then the token `next` after them, on `verifying`; the same
 * kept rows and `next` one by one on `stepping` (already at `start`). Every kept row's logits and next's are equal.
 */
const verifyThenRollBack = (
  verifying: ReadonlyArray<StageSession>,
  stepping: ReadonlyArray<StageSession>,
  start: number,
  rows: Int32Array,
  kept: number,
  next: number
) =>
  Effect.gen(function* () {
    const together = yield* step(verifying, start, rows, true)
    const vocab = together.length / rows.length
    const alone = yield* oneByOne(stepping, start, rows.subarray(0, kept + 1))
    for (let i = 0; i <= kept; i++) {
      assert.deepStrictEqual(together.slice(i * vocab, (i + 1) * vocab), alone[i], `verify row ${i}`)
    }
    const at = start + kept + 1
    const after = yield* step(verifying, at, Int32Array.of(next), false)
    const reference = yield* step(stepping, at, Int32Array.of(next), false)
    assert.deepStrictEqual(after, reference, `the step after ${kept} of ${rows.length - 1} drafts were kept`)
    return at + 1
  })

const rollBackEachWay = (stages: ReadonlyArray<LoadedStage>, vocab: number) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const open = () => Effect.forEach(stages, (s) => executor.session(s, { threads: 1, contextLength: 128 }))
    const rows = (r: Int32Array) => r.map((t) => t % vocab)
    // every draft refused, two kept, all kept; then a second verify step rolled back after the first's
    for (const kept of [0, 2, first.length - 1]) {
      const verifying = yield* open()
      const stepping = yield* open()
      yield* step(verifying, 0, prompt, false)
      yield* step(stepping, 0, prompt, false)
      const at = yield* verifyThenRollBack(verifying, stepping, prompt.length, rows(first), kept, 7)
      yield* verifyThenRollBack(verifying, stepping, at, rows(second), 1, 11)
    }
  })

/** Stage 0 to `cut` and `cut` to the end of the file's blocks (one stage for cut 0). */
const stagesOf = (path: string, cut: number) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const blocks = (yield* readModelHParams(yield* readGgufFile(path))).hp.nLayer
    if (cut === 0) {
      return [yield* executor.load({ path, layerStart: 0, layerEndExclusive: blocks, isFirst: true, isLast: true })]
    }
    return [
      yield* executor.load({ path, layerStart: 0, layerEndExclusive: cut, isFirst: true, isLast: false }),
      yield* executor.load({ path, layerStart: cut, layerEndExclusive: blocks, isFirst: false, isLast: true })
    ]
  })

describe("a speculative step's rows roll back on recurrent blocks: the states of the last kept row", () => {
  for (const [type, smallRows] of [
    ["f32", 7],
    ["q8_0", 0],
    ["q8_0", 7]
  ] as const) {
    it.live(`qwen35 ${type} (DeltaNet), 1 and 2 stages, few-row route up to ${smallRows} rows`, () =>
      Effect.gen(function* () {
        const o = qwen35(type)
        yield* writeSyntheticModel(o)
        yield* rollBackEachWay(yield* stagesOf(o.path, 0), o.vocab)
        // a cut after a DeltaNet block and before an attention block (3): both stages hold both kinds
        yield* rollBackEachWay(yield* stagesOf(o.path, 2), o.vocab)
      }).pipe(Effect.scoped, Effect.provide(StageExecutorLive.layerWith({ smallBatchRows: smallRows })))
    )
  }
  // the prompt cache copies a prefix into another session: one ending inside the last verify step's rows takes that
  // row's states from its snapshots (any other partial copy of a recurrent stage is refused)
  it.live("qwen35: a prefix copy ending inside a verify step's rows continues as the one-by-one decode", () =>
    Effect.gen(function* () {
      const o = qwen35("f32")
      yield* writeSyntheticModel(o)
      const stages = yield* stagesOf(o.path, 2)
      const executor = yield* StageExecutor
      const open = () => Effect.forEach(stages, (s) => executor.session(s, { threads: 1, contextLength: 128 }))
      const [verifying, stepping, copies] = [yield* open(), yield* open(), yield* open()]
      yield* step(verifying, 0, prompt, false)
      yield* step(stepping, 0, prompt, false)
      yield* step(verifying, prompt.length, first, true)
      yield* oneByOne(stepping, prompt.length, first.subarray(0, 3))
      const at = prompt.length + 3
      for (let i = 0; i < stages.length; i++) yield* executor.copyPrefix!(verifying[i]!, copies[i]!, at)
      const copied = yield* step(copies, at, Int32Array.of(7), false)
      assert.deepStrictEqual(copied, yield* step(stepping, at, Int32Array.of(7), false))
      // a copy ending before the verify step's rows cannot be exact: refused
      const refused = yield* Effect.exit(executor.copyPrefix!(verifying[0]!, copies[0]!, prompt.length - 1))
      assert.isTrue(refused._tag === "Failure" && String(refused).includes("cannot be rewound"), String(refused))
    }).pipe(Effect.scoped, Effect.provide(StageExecutorLive.layerWith({ smallBatchRows: 7 })))
  )
  it.live("kimi-k3 (KDA and MLA, gguf-py file), 1 and 2 stages", () =>
    Effect.gen(function* () {
      const path = writeConverted("kimi-k3", join(dir, "kimi-k3.gguf"), 7)
      const vocab = 512
      yield* rollBackEachWay(yield* stagesOf(path, 0), vocab)
      yield* rollBackEachWay(yield* stagesOf(path, 2), vocab)
    }).pipe(Effect.scoped, Effect.provide(StageExecutorLive.layerWith({ smallBatchRows: 7 })))
  )
})
