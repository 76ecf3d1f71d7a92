import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { mkdtempSync, readFileSync, rmSync, truncateSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { type SyntheticType, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { MAPPED_BUFFER_TYPE } from "../../src/layers/engine/Weights.js"
import { loadWeights } from "../../src/layers/engine/Weights.js"
import { layoutStage } from "../../src/layers/engine/StageLayout.js"
import { layerWith, LiveLoadedStage } from "../../src/layers/engine/StageExecutorLive.js"
import { openInProcessPipeline } from "../../src/services/InProcessPipeline.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { smallSynthetic } from "../support/batch.js"
import { requireModel } from "../support/models.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-mmap-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const sameBits = (a: Float32Array, b: Float32Array) =>
  a.length === b.length && new Uint32Array(a.buffer).every((x, i) => x === new Uint32Array(b.buffer)[i])

const argmax = (l: Float32Array) => l.reduce((best, x, i) => (x > l[best]! ? i : best), 0)

/** Logits of a prompt then 6 greedy steps through a split, with weights mapped or copied. */
const run = (path: string, boundaries: ReadonlyArray<number>, mmap: boolean) =>
  Effect.scoped(
    Effect.gen(function* () {
      const pipeline = yield* openInProcessPipeline(path, boundaries, { threads: 1, contextLength: 256 })
      const logits: Array<Float32Array> = []
      let last = yield* pipeline.run(0, Int32Array.of(1, 5, 9, 13, 17))
      for (let pos = 5; pos < 11; pos++) {
        logits.push(last)
        last = yield* pipeline.run(pos, Int32Array.of(argmax(last)))
      }
      logits.push(last)
      return logits
    })
  ).pipe(Effect.provide(layerWith({ mmap })))

const mappedPlacements = (path: string, layers: number) =>
  Effect.scoped(
    Effect.gen(function* () {
      const executor = yield* StageExecutor
      const stage = (yield* executor.load({
        path,
        layerStart: 0,
        layerEndExclusive: layers,
        isFirst: true,
        isLast: true
      })) as LiveLoadedStage
      return stage.placements.filter((p) => p.bufferType === MAPPED_BUFFER_TYPE).length
    })
  ).pipe(Effect.provide(layerWith({ mmap: true })))

const checkSame = (path: string, splits: ReadonlyArray<ReadonlyArray<number>>) =>
  Effect.gen(function* () {
    for (const split of splits) {
      const mapped = yield* run(path, split, true)
      const copied = yield* run(path, split, false)
      assert.strictEqual(mapped.length, copied.length)
      mapped.forEach((l, i) => assert.isTrue(sameBits(l, copied[i]!), `split ${JSON.stringify(split)} step ${i}`))
    }
  })

/** Prompt then 6 greedy steps on one stage holding every block; `midway` runs between the 3rd and 4th step. */
const oneStage = (
  path: string,
  layers: number,
  options: Parameters<typeof layerWith>[0],
  midway?: (stage: LiveLoadedStage) => Effect.Effect<void>
) =>
  Effect.scoped(
    Effect.gen(function* () {
      const executor = yield* StageExecutor
      const stage = (yield* executor.load({
        path,
        layerStart: 0,
        layerEndExclusive: layers,
        isFirst: true,
        isLast: true
      })) as LiveLoadedStage
      const session = yield* executor.session(stage, { threads: 1, contextLength: 256 })
      const logitsOf = (o: unknown) => (o as { readonly logits: Float32Array }).logits
      const logits: Array<Float32Array> = [
        logitsOf(yield* session.forward(0, { _tag: "Tokens", tokens: Int32Array.of(1, 5, 9, 13, 17) }))
      ]
      for (let pos = 5; pos < 11; pos++) {
        if (pos === 8 && midway !== undefined) yield* midway(stage)
        logits.push(
          logitsOf(yield* session.forward(pos, { _tag: "Tokens", tokens: Int32Array.of(argmax(logits.at(-1)!)) }))
        )
      }
      return { logits, stage }
    })
  ).pipe(Effect.provide(layerWith(options)))

describe("weights mapped from the file compute what copied weights compute", () => {
  it.live("stories260K (F32): bit-identical logits mapped and copied, 1 and 3 stages", () =>
    Effect.gen(function* () {
      const path = requireModel("stories260K.gguf")
      // every tensor is used in place (the check would be vacuous if mapping silently fell back to copies)
      assert.isAtLeast(yield* mappedPlacements(path, 5), 20)
      yield* checkSame(path, [
        [0, 5],
        [0, 2, 3, 5]
      ])
    })
  )

  const synthetic = (type: SyntheticType, tiedOutput: boolean) =>
    Effect.gen(function* () {
      const path = join(dir, `llama-${type}${tiedOutput ? "-tied" : ""}.gguf`)
      yield* writeSyntheticModel({ ...smallSynthetic(path, "llama", type, 256), seed: 3, tiedOutput })
      return path
    })

  it.live("synthetic Q8_0 (tied output: the last stage maps the embedding too): bit-identical logits", () =>
    Effect.gen(function* () {
      const path = yield* synthetic("q8_0", true)
      assert.isAtLeast(yield* mappedPlacements(path, 4), 1)
      yield* checkSame(path, [
        [0, 4],
        [0, 1, 3, 4]
      ])
    })
  )

  it.live("synthetic Q4_K (matrices repacked from the mapping): bit-identical logits", () =>
    Effect.gen(function* () {
      const path = yield* synthetic("q4_k", false)
      yield* checkSame(path, [
        [0, 4],
        [0, 2, 4]
      ])
    })
  )
})

describe("mapping lifetime", () => {
  it.live("the stage's mappings exist while it is loaded and are gone when its scope closes", () =>
    Effect.gen(function* () {
      const path = join(dir, "lifetime.gguf")
      yield* writeSyntheticModel({
        path,
        arch: "llama",
        layers: 2,
        hidden: 256,
        ffn: 512,
        heads: 4,
        kvHeads: 2,
        vocab: 400,
        contextLength: 256,
        type: "q8_0",
        seed: 6
      })
      const mappings = () =>
        readFileSync("/proc/self/maps", "utf8")
          .split("\n")
          .filter((l) => l.endsWith(path)).length
      const during = yield* Effect.scoped(
        Effect.gen(function* () {
          const executor = yield* StageExecutor
          yield* executor.load({ path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: true })
          return mappings()
        })
      ).pipe(Effect.provide(layerWith({ mmap: true })))
      assert.isAtLeast(during, 1)
      assert.strictEqual(mappings(), 0)
    })
  )
})

describe("a file that shrinks before it is mapped", () => {
  it.live(
    "is refused before any page is touched (an Error, no SIGBUS), and through the executor a ModelLoadError",
    () =>
      Effect.gen(function* () {
        const path = join(dir, "shrinks.gguf")
        yield* writeSyntheticModel({
          path,
          arch: "llama",
          layers: 2,
          hidden: 256,
          ffn: 512,
          heads: 4,
          kvHeads: 2,
          vocab: 400,
          contextLength: 256,
          type: "q8_0",
          seed: 4
        })
        const file = yield* readGgufFile(path)
        const plan = yield* layoutStage(file, {
          path,
          layerStart: 0,
          layerEndExclusive: 2,
          isFirst: true,
          isLast: true
        })
        // planned against the full file, then the file loses its tail
        truncateSync(path, file.fileSize - 4096)
        const error = yield* Effect.flip(Effect.tryPromise(() => loadWeights(plan, { mmap: true })))
        assert.match(String(error.cause), /the file is \d+ bytes now/)
        // the executor re-reads the table: a typed error naming the cause
        const exit = yield* Effect.exit(
          Effect.scoped(
            Effect.flatMap(StageExecutor, (e) =>
              e.load({ path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: true })
            )
          ).pipe(Effect.provide(layerWith({ mmap: true })))
        )
        assert.isTrue(Exit.isFailure(exit))
        if (Exit.isFailure(exit)) {
          const failure = exit.cause._tag === "Fail" ? exit.cause.error : undefined
          assert.strictEqual((failure as { _tag?: string } | undefined)?._tag, "ModelLoadError")
        }
      })
  )
})

describe("mapped weights moved to huge-page memory", () => {
  const model = Effect.gen(function* () {
    const path = join(dir, "llama-q8_0-move.gguf")
    yield* writeSyntheticModel({
      path,
      arch: "llama",
      layers: 4,
      hidden: 256,
      ffn: 512,
      heads: 4,
      kvHeads: 2,
      vocab: 400,
      contextLength: 256,
      type: "q8_0",
      seed: 3,
      tiedOutput: true
    })
    return path
  })

  // The fast start maps the file; then the weights move to huge-page memory between steps (decode ~12% faster).
  it.live(
    "mapped weights moved out of the mapping mid-generation: same bits before and after; the mapping is gone",
    () =>
      Effect.gen(function* () {
        const path = yield* model
        const copied = yield* oneStage(path, 4, { mmap: false })
        let moved: boolean | undefined
        let before = { mapped: 0, buffers: 0 }
        let after = { mapped: 0, buffers: 0 }
        const mapped = yield* oneStage(path, 4, { mmap: true }, (stage) =>
          Effect.promise(async () => {
            before = { mapped: stage.mappedBytes, buffers: stage.bufferBytes }
            moved = await stage.weights.moveOutOfMapping()
            after = { mapped: stage.mappedBytes, buffers: stage.bufferBytes }
          })
        )
        assert.isTrue(moved)
        assert.isAbove(before.mapped, 0, "weights were mapped before the move")
        assert.strictEqual(after.mapped, 0)
        assert.isAtLeast(after.buffers, before.buffers + before.mapped)
        mapped.logits.forEach((l, i) => assert.isTrue(sameBits(l, copied.logits[i]!), `step ${i}`))
      })
  )

  it.live("LoadedStage.settle moves the live engine's mapped weights out of the mapping", () =>
    Effect.gen(function* () {
      const path = yield* model
      const { stage } = yield* oneStage(path, 4, { mmap: true }, (loaded) =>
        Effect.gen(function* () {
          assert.isAbove(loaded.mappedBytes, 0)
          assert.isTrue(yield* loaded.settle())
        })
      )
      assert.strictEqual(stage.mappedBytes, 0)
    })
  )
})
