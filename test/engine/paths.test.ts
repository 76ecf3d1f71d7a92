/**
 * Forced paths: every way a CPU stage can compute a batch, each chosen by the test, never by the machine.
 *
 * Production measures whether a decode step of a few sequences takes the few-row route (Toolkit.mulMatSmall, an input
 * given as [K, 1, rows]; SmallBatch.ts) and places quantized weights in an extra (repacked) buffer type where the CPU
 * device agrees (WeightPlacement.ts). Here each choice is forced through LiveOptions: repack on/off x the few-row route
 * on (smallBatchRows 8) / off (0) x weights mapped from the file / copied, over stories260K (F32) and synthetic llama
 * models in Q8_0, Q4_K and Q6_K, at 1, 2 and 3 stages, with decode batches of 1..8 sequences and prefills inside
 * batches. For every case:
 *
 * - every sequence's greedy tokens from batched forwardBatch equal the same sequence run alone;
 * - where the path is bit-exact by design (every batch a sequence took part in was a lone call, or a decode step of
 *   several sequences on the few-row route over plain-buffer weights), its logits have exactly the lone bits;
 * - the forced path was taken: the placements say where the weights are (an extra type only with repack on, the
 *   file mapping only with mmap on), and the matrix products the graphs built say which route ran (few-row products
 *   with the route on, none with it off, never one over an extra-buffer weight: rule 2).
 *
 * Rule 1 is checked apart from the code that applies it (the device supports every row count's product over each
 * weight that went into an extra type), and rule 3 by a hand-built graph.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import koffi from "koffi"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll, vi } from "vitest"
import { type Ggml, getGgml, GgmlType, type Ptr, TensorLayout } from "../../src/layers/ggml/Bindings.js"
import { ggmlTypeName } from "../../src/domain/ggmlTypes.js"
import { syntheticTensorType, type SyntheticType, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { layerWith, LiveLoadedStage } from "../../src/layers/engine/StageExecutorLive.js"
import { checkGraph } from "../../src/layers/engine/WeightPlacement.js"
import { makeRng } from "../../src/services/Sampler.js"
import type { LoadedStage } from "../../src/services/StageExecutor.js"
import {
  type BatchCall,
  type BatchedSeqResult,
  loadSplit,
  maxAbsDiff,
  runAlone,
  runBatched,
  sameBits,
  smallSynthetic,
  type SeqPlan,
  type SeqResult
} from "../support/batch.js"
import { requireModel } from "../support/models.js"

const CONTEXT = 256
/** Tokens each sequence generates. */
const STEPS = 10
/** The few-row route's row limit when it is on. */
const ROUTE_ROWS = 8

const dir = mkdtempSync(join(tmpdir(), "swactor-engine-paths-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const ggml: Ggml = getGgml()
/** Names of the CPU device's extra buffer types on this machine (CPU_REPACK, AMX, ...); may be none. */
const extraNames: ReadonlySet<string> = new Set(
  ggml.cpuExtraBufferTypes().map((b) => ggml.raw.ggml_backend_buft_name(b))
)
const MAPPED = "CPU_Mapped"
const extraNote =
  extraNames.size === 0
    ? "this CPU has NO extra buffer type, so repack on places every weight as repack off does"
    : `extra buffer types here: ${[...extraNames].join(", ")}`
console.log(`engine.paths: ${extraNote}`)

interface PathModel {
  readonly name: string
  readonly path: () => Effect.Effect<string>
  readonly vocab: number
  readonly splits: ReadonlyArray<ReadonlyArray<number>>
  /** F32 weights: ggml's products of 2+ rows (tinyBLAS) give other bits than one-row products. */
  readonly f32: boolean
  /** A K-quant or Q4_0 type CPU_REPACK always takes on x86 (so repack on must really repack). */
  readonly repackable: boolean
}

/** Writes a synthetic model once per file (4 blocks, every matrix's ne0 a multiple of 256: no F16 fallback). */
const synthetic = (type: SyntheticType): PathModel => {
  let written: Promise<string> | undefined
  const write = () =>
    Effect.runPromise(
      Effect.gen(function* () {
        const path = join(dir, `llama-${type}.gguf`)
        const summary = yield* writeSyntheticModel(smallSynthetic(path, "llama", type, CONTEXT))
        // the requested type is really used: no matrix fell back to F16
        assert.deepStrictEqual(summary.fallbacks, [])
        const typeName = ggmlTypeName(syntheticTensorType(type, [256, 256]))
        assert.strictEqual(
          summary.tensorTypes[typeName],
          4 * 7 + 2,
          `${typeName}: ${JSON.stringify(summary.tensorTypes)}`
        )
        return path
      })
    )
  return {
    name: `synthetic llama ${type}`,
    path: () => Effect.promise(() => (written ??= write())),
    vocab: 400,
    splits: [
      [0, 4],
      [0, 2, 4],
      [0, 1, 3, 4]
    ],
    f32: false,
    repackable: type === "q4_k"
  }
}

const models: ReadonlyArray<PathModel> = [
  {
    name: "stories260K",
    path: () => Effect.sync(() => requireModel("stories260K.gguf")),
    vocab: 512,
    splits: [
      [0, 5],
      [0, 2, 5],
      [0, 1, 3, 5]
    ],
    f32: true,
    repackable: false
  },
  synthetic("q8_0"),
  synthetic("q4_k"),
  synthetic("q6_k")
]

/**
 * Decode ramp: sequence i (prompt of 2 + i tokens) prefills alone at step i, then decodes with the others: the decode
 * batches carry 1, 2, ..., 8, 8, 7, ..., 1 sequences (every row count 1..8, each only decode steps).
 */
const rampSchedule = (vocab: number): ReadonlyArray<SeqPlan> => {
  const r = makeRng(91)
  return Array.from({ length: 8 }, (_, i): SeqPlan => ({
    prompt: Array.from({ length: 2 + i }, () => 3 + Math.floor(r() * (vocab - 3))),
    start: i,
    steps: STEPS,
    prefillAlone: true
  }))
}

/**
 * Prefills inside batches: two prompts prefill together (5 rows, within the route's limit), a third joins decoding
 * ones (6 rows), a fourth is prefilled in chunks of 7 while the others decode (10 rows, past the limit).
 */
const prefillSchedule = (vocab: number): ReadonlyArray<SeqPlan> => {
  const r = makeRng(17)
  const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * (vocab - 3)))
  return [
    { prompt: prompt(3), start: 0, steps: STEPS },
    { prompt: prompt(2), start: 0, steps: STEPS },
    { prompt: prompt(4), start: 2, steps: STEPS - 2 },
    { prompt: prompt(20), start: 3, steps: STEPS - 4, chunk: 7 }
  ]
}

/** Matrix products the graphs built while watching: the few-row ones ([K, 1, rows] input) by weight buffer type. */
interface ProductLog {
  /** buffer type name of the weight -> row counts of its few-row products */
  readonly fewRow: Map<string, Set<number>>
  /** products with an input of 2+ rows given as [K, rows] */
  plainMultiRow: number
}

/** Records every ggml_mul_mat the graphs build (scoped: the original is back when the scope closes). */
const watchProducts = Effect.acquireRelease(
  Effect.sync(() => {
    const raw = ggml.raw
    const original = raw.ggml_mul_mat
    const log: ProductLog = { fewRow: new Map(), plainMultiRow: 0 }
    const spy = vi.spyOn(raw, "ggml_mul_mat").mockImplementation((ctx: Ptr, a: Ptr, b: Ptr) => {
      const x = ggml.tensorShape(b)
      if (x.ne[1] === 1 && x.ne[2]! > 1) {
        const buffer = koffi.decode(a, TensorLayout.buffer, "void *") as Ptr | null
        const home =
          buffer === null ? "(no buffer)" : raw.ggml_backend_buft_name(raw.ggml_backend_buffer_get_type(buffer))
        if (!log.fewRow.has(home)) log.fewRow.set(home, new Set())
        log.fewRow.get(home)!.add(x.ne[2]!)
      } else if (x.ne[1]! > 1) {
        log.plainMultiRow++
      }
      return original(ctx, a, b)
    })
    return { log, spy }
  }),
  ({ spy }) => Effect.sync(() => spy.mockRestore())
).pipe(Effect.map(({ log }) => log))

const PRODUCT_WEIGHT = /(^|\.)(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight$|^output\.weight$/

const placementsOf = (stages: ReadonlyArray<LoadedStage>) =>
  stages.flatMap((s) => {
    assert.instanceOf(s, LiveLoadedStage)
    return (s as LiveLoadedStage).placements
  })

/**
 * Row counts a stage's products can have: a decode step, decode steps of up to 16 sequences, prefill chunks and
 * micro-batches (kept here, not read from WeightPlacement.PRODUCT_ROWS, so that shrinking that list is caught).
 */
const ROWS_BUILT = [...Array.from({ length: 16 }, (_, i) => i + 1), 32, 64, 128, 256, 512]

/**
 * Rule 1, checked apart from WeightPlacement.chooseExtraBuffer: over every weight that went into an extra buffer
 * type, as loaded (its real buffer), the CPU device computes the F32 [K, rows] product of every row count.
 */
const extraWeightsSupported = (stages: ReadonlyArray<LoadedStage>) => {
  const raw = ggml.raw
  let checked = 0
  for (const s of stages as ReadonlyArray<LiveLoadedStage>) {
    for (const p of s.placements) {
      if (!extraNames.has(p.bufferType)) continue
      assert.match(p.name, PRODUCT_WEIGHT, `only product weights go into an extra type (${p.name} in ${p.bufferType})`)
      const w = s.weights.get(p.name)
      const { ne } = ggml.tensorShape(w)
      const ctx = raw.ggml_init({
        mem_size: raw.ggml_tensor_overhead() * (2 * ROWS_BUILT.length + 1),
        mem_buffer: null,
        no_alloc: true
      })
      try {
        for (const rows of ROWS_BUILT) {
          const y = raw.ggml_mul_mat(ctx, w, raw.ggml_new_tensor_2d(ctx, GgmlType.F32, ne[0]!, rows))
          assert.isTrue(
            raw.ggml_backend_dev_supports_op(ggml.cpuDevice(), y),
            `${p.name} (${p.bufferType}), ${rows} rows`
          )
        }
      } finally {
        raw.ggml_free(ctx)
      }
      checked++
    }
  }
  return checked
}

/** Lone runs, per model, repack setting and split: they never batch, so neither the route nor mapping changes them. */
const loneRuns = new Map<string, { ramp: ReadonlyArray<SeqResult>; prefill: ReadonlyArray<SeqResult> }>()

interface PathCase {
  readonly model: PathModel
  readonly repack: boolean
  readonly mmap: boolean
  readonly rows: 0 | 8
}

const caseName = ({ mmap, model, repack, rows }: PathCase) =>
  `${model.name}, repack ${repack ? "on" : "off"}${repack && extraNames.size === 0 ? " (NO extra buffer type on this CPU)" : ""}, ` +
  `${mmap ? "mapped" : "copied"} weights, few-row route ${rows > 0 ? `on (${rows} rows)` : "off (0)"}`

/** Is a batch bit-exact against the lone runs by design? A lone call, or decode steps on the few-row route over plain weights. */
const exactByDesign = (call: BatchCall, rows: number, allPlain: boolean) =>
  call.items === 1 || (allPlain && call.decodeOnly && call.rows >= 2 && call.rows <= rows)

const runCase = (c: PathCase) =>
  Effect.gen(function* () {
    const path = yield* c.model.path()
    const report: Array<string> = []
    for (const split of c.model.splits) {
      yield* Effect.scoped(
        Effect.gen(function* () {
          const stages = yield* loadSplit(path, split)
          const at = `split ${JSON.stringify(split)}`

          // the placements are the forced ones
          const placements = placementsOf(stages)
          const inExtra = placements.filter((p) => extraNames.has(p.bufferType))
          const mapped = placements.filter((p) => p.bufferType === MAPPED)
          if (!c.repack) {
            const some = inExtra
              .slice(0, 3)
              .map((p) => `${p.name} (${p.bufferType})`)
              .join(", ")
            assert.strictEqual(
              inExtra.length,
              0,
              `${at}: repack off, yet ${inExtra.length} weights in an extra type: ${some}...`
            )
          }
          if (c.repack && c.model.repackable && extraNames.has("CPU_REPACK")) {
            assert.isAbove(
              inExtra.length,
              0,
              `${at}: repack on over ${c.model.name}: some weight is in an extra buffer type`
            )
          }
          if (c.mmap) assert.isAbove(mapped.length, 0, `${at}: mmap on: some weight is used in place (${MAPPED})`)
          else assert.strictEqual(mapped.length, 0, `${at}: mmap off: no weight is ${MAPPED}`)
          assert.strictEqual(extraWeightsSupported(stages), inExtra.length)
          const allPlain = inExtra.length === 0
          const plainProducts = placements.some((p) => PRODUCT_WEIGHT.test(p.name) && !extraNames.has(p.bufferType))

          const key = `${c.model.name}|${c.repack}|${split}`
          const ramp = rampSchedule(c.model.vocab)
          const prefill = prefillSchedule(c.model.vocab)
          let alone = loneRuns.get(key)
          if (alone === undefined) {
            alone = {
              ramp: yield* Effect.forEach(ramp, (p) => Effect.scoped(runAlone(stages, p, CONTEXT))),
              prefill: yield* Effect.forEach(prefill, (p) => Effect.scoped(runAlone(stages, p, CONTEXT)))
            }
            loneRuns.set(key, alone)
          }

          // the batched runs, watching which products their graphs build
          const { byRamp, byPrefill, log } = yield* Effect.scoped(
            Effect.gen(function* () {
              const log = yield* watchProducts
              const byRamp = yield* runBatched(stages, ramp, CONTEXT)
              const byPrefill = yield* runBatched(stages, prefill, CONTEXT)
              return { byRamp, byPrefill, log }
            })
          )
          assert.strictEqual(byRamp.maxLive, 8, `${at}: 8 sequences decoded together`)
          assert.deepStrictEqual(
            [...byRamp.decodeRows].sort((a, b) => a - b),
            [2, 3, 4, 5, 6, 7, 8],
            `${at}: decode batches of 2..8 rows`
          )
          assert.isTrue(byPrefill.mixed, `${at}: some batch mixed prefill and decode`)
          assert.isAtLeast(new Set(alone.ramp.flatMap((a) => a.tokens)).size, 8, `${at}: the streams are not trivial`)

          // tokens: always the lone ones; logits: the lone bits where the path is exact by design
          let exactChecked = 0
          let otherBits = 0
          let maxDiff = 0
          const compare = (name: string, lone: ReadonlyArray<SeqResult>, batched: ReadonlyArray<BatchedSeqResult>) =>
            lone.forEach((a, i) => {
              const b = batched[i]!
              assert.deepStrictEqual(b.tokens, a.tokens, `${at}: ${name} sequence ${i}: batched tokens = lone tokens`)
              a.logits.forEach((l, j) => {
                const exact = b.calls
                  .slice(0, b.logitsCall[j]! + 1)
                  .every((call) => exactByDesign(call, c.rows, allPlain))
                const same = sameBits(l, b.logits[j]!)
                if (!same) otherBits++
                maxDiff = Math.max(maxDiff, maxAbsDiff(l, b.logits[j]!))
                if (exact) {
                  exactChecked++
                  assert.isTrue(
                    same,
                    `${at}: ${name} sequence ${i} token ${j}: the lone logits' bits (exact by design)`
                  )
                }
              })
            })
          compare("ramp", alone.ramp, byRamp.results)
          compare("prefill", alone.prefill, byPrefill.results)
          // on the route over plain weights the whole ramp is exact by design (and no prefill-schedule logit is: each
          // of its sequences was in a batch with a prefill): every one of the ramp's logits was compared bit for bit
          if (c.rows > 0 && allPlain)
            assert.strictEqual(exactChecked, 8 * STEPS, `${at}: every ramp logit is bit-exact by design`)

          // the route really taken (or not)
          const fewRowHomes = [...log.fewRow.keys()]
          assert.isFalse(
            fewRowHomes.some((h) => extraNames.has(h)),
            `${at}: no few-row product over an extra-type weight (rule 2): ${fewRowHomes}`
          )
          if (c.rows === 0) {
            assert.strictEqual(log.fewRow.size, 0, `${at}: route off: no few-row product (${fewRowHomes})`)
            // F32: tinyBLAS takes the batched rows and gives other bits than the one-row products of the lone runs
            if (c.model.f32)
              assert.isAbove(otherBits, 0, `${at}: route off over F32: some batched logits differ from lone`)
          } else if (plainProducts) {
            const rowsSeen = new Set([...log.fewRow.values()].flatMap((s) => [...s]))
            for (let r = 2; r <= c.rows; r++)
              assert.isTrue(rowsSeen.has(r), `${at}: a few-row product of ${r} rows (${[...rowsSeen]})`)
            assert.isTrue(
              [...rowsSeen].every((r) => r <= c.rows),
              `${at}: none past ${c.rows} rows (${[...rowsSeen]})`
            )
          } else {
            assert.strictEqual(
              log.fewRow.size,
              0,
              `${at}: every product weight is in an extra type: no few-row product`
            )
          }
          assert.isAbove(log.plainMultiRow, 0, `${at}: prefills of several rows as [K, rows] products`)

          const counts = new Map<string, number>()
          for (const p of placements) counts.set(p.bufferType, (counts.get(p.bufferType) ?? 0) + 1)
          report.push(
            `${at}: placements ${JSON.stringify(Object.fromEntries(counts))}, few-row products over ` +
              `${JSON.stringify(Object.fromEntries([...log.fewRow].map(([k, v]) => [k, [...v].sort((a, b) => a - b)])))}, ` +
              `${exactChecked} logits bit-exact by design, ${otherBits} with other bits, max |diff| ${maxDiff.toExponential(2)}`
          )
        })
      )
    }
    console.log(`${caseName(c)}:\n  ${report.join("\n  ")}`)
  }).pipe(Effect.provide(layerWith({ repack: c.repack, mmap: c.mmap, smallBatchRows: c.rows })))

describe("forced paths: batched = alone, on every route x placement, 1..3 stages, 1..8 rows", () => {
  for (const model of models) {
    for (const repack of [false, true]) {
      for (const mmap of [true, false]) {
        for (const rows of [0, ROUTE_ROWS] as const) {
          const c: PathCase = { model, repack, mmap, rows }
          it.live(caseName(c), () => runCase(c), 60_000)
        }
      }
    }
  }
})

describe("WeightPlacement rule 3: checkGraph before a graph computes", () => {
  /**
   * A [K, rows] product and a [K, 1, rows] one (the few-row route's shape) over one weight `w`, each in a graph of
   * its own; `check` gets both graphs. Nothing is allocated or computed.
   */
  const twoShapes = (w: Ptr, rows: number, check: (flat: Ptr, fewRow: Ptr) => void) => {
    const raw = ggml.raw
    const ctx = raw.ggml_init({
      mem_size: raw.ggml_tensor_overhead() * 16 + raw.ggml_graph_overhead_custom(16, false) * 2,
      mem_buffer: null,
      no_alloc: true
    })
    try {
      const k = ggml.tensorShape(w).ne[0]!
      const x = raw.ggml_new_tensor_2d(ctx, GgmlType.F32, k, rows)
      const graphOf = (y: Ptr) => {
        const gr = raw.ggml_new_graph_custom(ctx, 16, false)
        raw.ggml_build_forward_expand(gr, y)
        return gr
      }
      check(
        graphOf(raw.ggml_mul_mat(ctx, w, x)),
        graphOf(raw.ggml_mul_mat(ctx, w, raw.ggml_reshape_3d(ctx, x, k, 1, rows)))
      )
    } finally {
      raw.ggml_free(ctx)
    }
  }

  const refused = (f: () => void): Error => {
    try {
      f()
    } catch (e) {
      assert.instanceOf(e, Error)
      return e as Error
    }
    return assert.fail("checkGraph accepted the graph")
  }

  const q4k = models.find((m) => m.name === "synthetic llama q4_k")!
  const loadQ4k = (repack: boolean) =>
    Effect.gen(function* () {
      const path = yield* q4k.path()
      const [stage] = yield* loadSplit(path, [0, 4])
      return stage as LiveLoadedStage
    }).pipe(Effect.provide(layerWith({ repack, mmap: false, smallBatchRows: 0 })))

  it.live(
    extraNames.has("CPU_REPACK")
      ? "a [K, 1, rows] product over a repacked weight (Q4_K, repack on) is refused with a clear Error; [K, rows] over it and [K, 1, rows] over a plain weight pass"
      : `NO CPU_REPACK on this CPU (${extraNote}): the rule is checked with a plain weight standing in as repacked (by address)`,
    () =>
      Effect.gen(function* () {
        const repacked = yield* loadQ4k(true)
        const name = "blk.0.ffn_up.weight"
        const w = repacked.weights.get(name)
        const home = repacked.placements.find((p) => p.name === name)!.bufferType
        let extraSet = repacked.weights.extraWeights
        if (extraNames.has("CPU_REPACK")) {
          assert.isTrue(extraNames.has(home), `${name} is in an extra type (${home})`)
          assert.isTrue(extraSet.has(koffi.address(w)))
        } else {
          console.log(
            `engine.paths rule 3: ${extraNote}; ${name} is ${home}, declared repacked by address for the check`
          )
          extraSet = new Set([koffi.address(w)])
        }
        const dev = ggml.cpuDevice()
        twoShapes(w, 4, (flat, fewRow) => {
          checkGraph(ggml, dev, flat, extraSet)
          const e = refused(() => checkGraph(ggml, dev, fewRow, extraSet))
          assert.match(
            e.message,
            /graph node \d+ \(MUL_MAT\): a product over a repacked weight with an input of shape \[256,1,4,1\]/
          )
          assert.match(e.message, /F32 \[K, rows\] inputs only/)
        })
        // the same few-row product over a weight in the plain buffer is what the route is for: accepted
        const plain = yield* loadQ4k(false)
        const pw = plain.weights.get(name)
        assert.strictEqual(plain.placements.find((p) => p.name === name)!.bufferType, "CPU")
        twoShapes(pw, 4, (flat, fewRow) => {
          checkGraph(ggml, dev, flat, plain.weights.extraWeights)
          checkGraph(ggml, dev, fewRow, plain.weights.extraWeights)
        })
      }).pipe(Effect.scoped)
  )
})
