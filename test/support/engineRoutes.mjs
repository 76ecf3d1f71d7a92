// swactor's engine in this process (the built library, dist/), each CPU kernel route forced in turn, for a test that
// runs it under qemu-aarch64 (test/arm64/routes.test.ts): node engineRoutes.mjs JOB, JOB a JSON object
//   {files: [{model, prompts: [[token ids]]}], n, routes: [{repack, smallBatchRows}]}
// -> one JSON line {arch, cpuBackend, cpuFeatures, files: [[{repack, smallBatchRows, placements, fewRowProducts,
// alone, batched}]]} (per file, per route). Per route, the whole model is one stage loaded with those LiveOptions
// (repack: weights into the CPU device's extra buffer types where WeightPlacement.ts's rule 1 agrees, or never;
// smallBatchRows: the few-row route's row limit, 0 never), then every prompt generates `n` greedy tokens alone (one
// session, its prompt in one forward) and all prompts together (one forwardBatch per step over every sequence: the
// batched prompts, then each decode step). placements names each weight's buffer type; fewRowProducts is the number of
// products the stage's graphs built on the few-row route (Toolkit.ts's fewRowProducts); cpuFeatures what ggml's repack
// selector reads from the loaded CPU backend. One thread, a 256-token context, as cpuReference.mjs runs.
import { Effect } from "effect"
import koffi from "koffi"
import { readFileSync } from "node:fs"
import * as StageExecutorLive from "../../dist/layers/engine/StageExecutorLive.js"
import { fewRowProducts } from "../../dist/layers/engine/Toolkit.js"
import { readModelFacts } from "../../dist/layers/gguf/ModelCatalogLive.js"
import { greedy } from "../../dist/services/Sampler.js"

const job = JSON.parse(process.argv[2])
const CONTEXT = 256

const greedyRun = (step, prompts, n) =>
  Effect.gen(function* () {
    const tokens = prompts.map(() => [])
    let feeds = prompts
    let pos = prompts.map(() => 0)
    while (tokens[0].length < n) {
      const logits = yield* step(pos, feeds)
      pos = pos.map((p, i) => p + feeds[i].length)
      feeds = logits.map((l, i) => {
        const t = greedy(l)
        tokens[i].push(t)
        return [t]
      })
    }
    return tokens
  })

const logitsOf = (out) => {
  if (out._tag !== "Logits") throw new Error(`a one-stage forward gave ${out._tag}, not logits`)
  return out.logits
}
const tokensInput = (ids) => ({ _tag: "Tokens", tokens: Int32Array.from(ids) })

const runRoute = (file, route, numLayers) =>
  Effect.scoped(
    Effect.gen(function* () {
      const executor = StageExecutorLive.make({
        repack: route.repack,
        smallBatchRows: route.smallBatchRows,
        mmap: true
      })
      const stage = yield* executor.load({
        path: file.model,
        layerStart: 0,
        layerEndExclusive: numLayers,
        isFirst: true,
        isLast: true
      })
      const builtBefore = fewRowProducts.count
      const open = () => executor.session(stage, { threads: 1, contextLength: CONTEXT })
      const alone = []
      for (const prompt of file.prompts) {
        const session = yield* open()
        const step = (pos, feeds) =>
          Effect.map(session.forward(pos[0], tokensInput(feeds[0])), (out) => [logitsOf(out)])
        alone.push((yield* greedyRun(step, [prompt], job.n))[0])
      }
      const sessions = []
      for (let i = 0; i < file.prompts.length; i++) sessions.push(yield* open())
      const batchStep = (pos, feeds) =>
        Effect.map(
          executor.forwardBatch(
            sessions.map((session, i) => ({ session, startPos: pos[i], input: tokensInput(feeds[i]) }))
          ),
          (outs) => outs.map(logitsOf)
        )
      const batched = yield* greedyRun(batchStep, file.prompts, job.n)
      const placements = Object.fromEntries(stage.placements.map((p) => [p.name, p.bufferType]))
      return { ...route, placements, fewRowProducts: fewRowProducts.count - builtBefore, alone, batched }
    })
  )

const program = Effect.forEach(job.files, (file) =>
  Effect.gen(function* () {
    const facts = yield* readModelFacts(file.model)
    return yield* Effect.forEach(job.routes, (route) => runRoute(file, route, facts.numLayers))
  })
)

const files = await Effect.runPromise(program)
// the CPU backend variant ggml loaded for this CPU (libggml-cpu-<variant>.so): which arm64 kernels it has
const cpuBackend = [
  ...new Set(
    readFileSync("/proc/self/maps", "utf8")
      .split("\n")
      .map((line) => line.split(/\s+/).at(-1) ?? "")
      .filter((path) => /libggml-cpu[^/]*\.so$/.test(path))
  )
]
// what ggml's repack selector reads from that backend (ggml-cpu/repack.cpp): dot-product and int8 matrix-multiply
// instructions, and the SVE vector length in bytes (0 without SVE)
const cpu = koffi.load(cpuBackend[0])
const ask = (name) => cpu.func(`int ${name}(void)`)()
const cpuFeatures = {
  dotprod: ask("ggml_cpu_has_dotprod") === 1,
  i8mm: ask("ggml_cpu_has_matmul_int8") === 1,
  sveBytes: ask("ggml_cpu_has_sve") === 1 ? ask("ggml_cpu_get_sve_cnt") : 0
}
console.log(JSON.stringify({ arch: process.arch, cpuBackend, cpuFeatures, files }))
