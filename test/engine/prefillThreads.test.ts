/**
 * SessionOptions.prefillThreads: a lone call of several rows (a prompt) takes the session's prefill threads, every
 * other call its threads, and the logits are bit for bit those of a session that prefills with its own threads (ggml's
 * CPU kernels give each output element to one thread). Forced both ways on each weight type here: F32 (stories260K,
 * tinyBLAS for its prompt), Q8_0 and F16 (synthetic), against one-thread sessions on the same loaded weights.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import type { StageOutput } from "../../src/domain/engine.js"
import * as StageExecutorLive from "../../src/layers/engine/StageExecutorLive.js"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { requireModel } from "../support/models.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-prefill-threads-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const synthetic = (type: "q8_0" | "f16" | "q4_k") =>
  Effect.promise(async () => {
    const path = join(dir, `llama-${type}.gguf`)
    await Effect.runPromise(
      writeSyntheticModel({
        path,
        arch: "llama",
        layers: 2,
        hidden: 256,
        ffn: 1024,
        heads: 4,
        kvHeads: 2,
        vocab: 400,
        contextLength: 256,
        type,
        seed: 5
      })
    )
    return path
  })

const bitsOf = (output: StageOutput) => {
  if (output._tag !== "Logits") return assert.fail(`a last stage gave ${output._tag}`)
  const logits = output.logits
  return Buffer.from(logits.buffer, logits.byteOffset, logits.byteLength).toString("base64")
}

/** A 9-token prompt then 3 decode steps on a one-thread session and on one with `prefillThreads`; threads seen. */
const compare = (path: string, blocks: number, prefillThreads: number) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const stage = yield* executor.load({ path, layerStart: 0, layerEndExclusive: blocks, isFirst: true, isLast: true })
    const weights = (stage as StageExecutorLive.LiveLoadedStage).weights
    const plain = yield* executor.session(stage, { threads: 1, contextLength: 64 })
    const wide = yield* executor.session(stage, { threads: 1, prefillThreads, contextLength: 64 })
    const prompt = Int32Array.from([1, 17, 42, 99, 3, 250, 7, 31, 64])
    const plainBits = [bitsOf(yield* plain.forward(0, { _tag: "Tokens", tokens: prompt }))]
    const plainThreads = [weights.lastThreads]
    const wideBits = [bitsOf(yield* wide.forward(0, { _tag: "Tokens", tokens: prompt }))]
    const wideThreads = [weights.lastThreads]
    for (let step = 0; step < 3; step++) {
      const token = Int32Array.from([5 + step * 11])
      plainBits.push(bitsOf(yield* plain.forward(prompt.length + step, { _tag: "Tokens", tokens: token })))
      plainThreads.push(weights.lastThreads)
      wideBits.push(bitsOf(yield* wide.forward(prompt.length + step, { _tag: "Tokens", tokens: token })))
      wideThreads.push(weights.lastThreads)
    }
    return { plainBits, wideBits, plainThreads, wideThreads }
  }).pipe(Effect.scoped)

describe("StageExecutorLive: prefill threads", () => {
  const cases: ReadonlyArray<readonly [string, Effect.Effect<string>, number]> = [
    ["F32 (stories260K)", Effect.sync(() => requireModel("stories260K.gguf")), 5],
    ["Q8_0 (synthetic)", synthetic("q8_0"), 2],
    ["F16 (synthetic)", synthetic("f16"), 2],
    ["Q4_K (synthetic)", synthetic("q4_k"), 2]
  ]
  // where the weights live is the CPU's choice (repacked buffer types): forced both ways
  for (const repack of [false, true]) {
    for (const [name, model, blocks] of cases) {
      it.effect(
        `${name}, repack ${repack ? "on" : "off"}: the prompt runs on the prefill threads, decode steps on the session's; the same bits`,
        () =>
          Effect.gen(function* () {
            const seen = yield* compare(yield* model, blocks, 2)
            assert.deepStrictEqual(seen.plainThreads, [1, 1, 1, 1])
            assert.deepStrictEqual(seen.wideThreads, [2, 1, 1, 1])
            assert.deepStrictEqual(seen.wideBits, seen.plainBits)
          }).pipe(Effect.provide(StageExecutorLive.layerWith({ repack })))
      )
    }
  }

  it.effect("prefill threads outside what the engine takes are refused", () =>
    Effect.gen(function* () {
      const executor = yield* StageExecutor
      const stage = yield* executor.load({
        path: requireModel("stories260K.gguf"),
        layerStart: 0,
        layerEndExclusive: 5,
        isFirst: true,
        isLast: true
      })
      const exit = yield* executor.session(stage, { threads: 1, prefillThreads: 0 }).pipe(Effect.exit)
      assert.isTrue(exit._tag === "Failure")
      assert.match(String(exit), /threads must be a whole number/)
    }).pipe(Effect.scoped, Effect.provide(StageExecutorLive.layer))
  )
})
