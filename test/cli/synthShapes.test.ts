/**
 * `swactor synth` over a seeded sample of its shapes, per architecture (P11 in specs/BEHAVIOR_GUARANTEES.md): every
 * command line it accepts writes a file that node-llama-cpp loads and whose greedy tokens swactor's engine gives;
 * every one it refuses is refused by a typed error of one line that names one of the flags given.
 *
 * The shapes: layers 1-6 (each count accepted at least once per architecture), hidden sizes that are and are not
 * multiples of the head count (with --head-dim) and of 256, vocabularies of 259 to 32000, the storage types, and each
 * architecture's optional parts given and not given. The sample is seeded: the same cases every run, and the test
 * checks that it reaches each of those states.
 */
import { assert, describe, it } from "@effect/vitest"
import { Cause, Effect, Exit, Option } from "effect"
import { existsSync } from "node:fs"
import { join } from "node:path"
import { type SyntheticArch, syntheticArchs } from "../../src/layers/gguf/Synthetic.js"
import { makeRng } from "../../src/services/Sampler.js"
import { greedyRun, referenceRun } from "../support/engine.js"
import { runSynthCli } from "../support/synthCli.js"
import { modelFolder } from "../support/synthFiles.js"

const dir = modelFolder("swactor-synth-shapes-")
/** Accepted shapes checked per architecture. */
const ACCEPTED = 12
/** Greedy tokens compared per shape. */
const N_TOKENS = 6
/** The synthetic vocabulary's end of sequence (no chat template): node-llama-cpp stops before it, we return it. */
const EOS = 2
const RUN = { threads: 1, contextLength: 128 } as const

const moeArchs: ReadonlyArray<SyntheticArch> = ["qwen3moe", "glm4moe", "deepseek2", "gpt-oss", "qwen35moe"]
const windowArchs: ReadonlyArray<SyntheticArch> = ["gemma3", "gemma4", "gpt-oss"]

/** The architecture's optional parts: the flags the generator gives or leaves out (besides the common ones). */
const optionalFlags = (arch: SyntheticArch): ReadonlyArray<string> => [
  "--heads",
  "--kv-heads",
  "--head-dim",
  "--tied-output",
  ...(windowArchs.includes(arch) ? ["--sliding-window", "--swa-pattern"] : []),
  ...(arch === "gemma3" || arch === "gemma4" ? ["--logit-softcap"] : []),
  ...(arch === "gemma4"
    ? ["--k-eq-v", "--per-layer-embd", "--shared-kv-layers", "--swa-head-dim", "--global-kv-heads"]
    : []),
  ...(arch === "gemma4" ? ["--double-wide-shared-ffn"] : []),
  ...(moeArchs.includes(arch) || arch === "gemma4" || arch === "mistral3"
    ? ["--experts", "--experts-used", "--expert-ffn"]
    : []),
  ...(arch === "glm4moe" || arch === "deepseek2" || arch === "qwen35moe" ? ["--shared-experts"] : []),
  ...(arch === "glm4moe" || arch === "deepseek2" ? ["--dense-blocks"] : []),
  ...(arch === "glm4moe" || arch === "qwen35" || arch === "qwen35moe" ? ["--nextn-layers"] : []),
  ...(arch === "deepseek2" ? ["--kv-lora-rank", "--q-lora-rank"] : [])
]

/** Flags of other architectures, given now and then: the command must refuse them by name. */
const foreignFlags: ReadonlyArray<ReadonlyArray<string>> = [
  ["--k-eq-v"],
  ["--sliding-window", "8"],
  ["--logit-softcap", "10"],
  ["--experts", "2"],
  ["--nextn-layers", "1"],
  ["--kv-lora-rank", "16"],
  ["--shared-experts", "1"],
  ["--per-layer-embd", "8"]
]

/** One command line for `arch` of `layers` blocks, drawn from `r`. */
const drawShape = (arch: SyntheticArch, layers: number, r: () => number): Array<string> => {
  const pick = <T>(xs: ReadonlyArray<T>): T => xs[Math.floor(r() * xs.length)]!
  const chance = (p: number) => r() < p
  const args = ["--arch", arch, "--layers", String(layers)]
  const hidden = pick([16, 48, 64, 96, 100, 128, 192, 256, 320, 512])
  args.push("--hidden", String(hidden))
  args.push("--ffn", String(pick([16, 33, 64, 100, 256])))
  // heads from the shape (no --heads), dividing --hidden, or not (then mostly with --head-dim, else refused)
  const headsMode = pick(["default", "dividing", "other"])
  if (headsMode !== "default") {
    const candidates = [1, 2, 3, 4, 6, 8].filter((h) => (hidden % h === 0) === (headsMode === "dividing"))
    const heads = pick(candidates.length > 0 ? candidates : [1])
    args.push("--heads", String(heads))
    if (chance(0.5)) args.push("--kv-heads", String(pick([1, 2, heads])))
  }
  if (chance(headsMode === "other" ? 0.8 : 0.3)) args.push("--head-dim", String(pick([16, 24, 32, 40, 64])))
  args.push("--vocab", String(pick([259, 300, 512, 8000, 32000])))
  args.push("--type", pick(["f32", "f32", "f16", "q8_0", "q4_k"]))
  if (chance(0.5)) args.push("--tied-output")
  args.push("--seed", String(Math.floor(r() * 1000)))
  const flags = optionalFlags(arch)
  const maybe = (flag: string, values: ReadonlyArray<number>) => {
    if (flags.includes(flag) && chance(0.5)) args.push(flag, String(pick(values)))
  }
  const moe = moeArchs.includes(arch)
  // gemma4 and mistral3 have experts only when asked for
  if (moe || (flags.includes("--experts") && chance(0.5))) {
    const experts = pick([1, 2, 4, 8])
    if (!moe || chance(0.7)) args.push("--experts", String(experts))
    maybe("--experts-used", [1, 2, experts])
    maybe("--expert-ffn", [32, 48, 64, 100])
  }
  maybe("--shared-experts", [0, 1, 2])
  maybe("--dense-blocks", [0, 1, 2])
  maybe("--nextn-layers", [0, 1, 2])
  maybe("--kv-lora-rank", [16, 32, 48, 64])
  maybe("--q-lora-rank", [0, 16, 64])
  maybe("--sliding-window", [1, 4, 16, 32])
  maybe("--swa-pattern", [1, 2, 3, 6])
  maybe("--logit-softcap", [5, 30])
  if (flags.includes("--k-eq-v") && chance(0.5)) args.push("--k-eq-v")
  maybe("--per-layer-embd", [0, 8, 16])
  maybe("--shared-kv-layers", [0, 1, 2])
  maybe("--swa-head-dim", [16, 32])
  maybe("--global-kv-heads", [1, 2])
  if (flags.includes("--double-wide-shared-ffn") && chance(0.5)) args.push("--double-wide-shared-ffn")
  if (chance(0.1)) {
    const foreign = pick(foreignFlags)
    if (!flags.includes(foreign[0]!) && !args.includes(foreign[0]!)) args.push(...foreign)
  }
  return args
}

const value = (args: ReadonlyArray<string>, flag: string): number | undefined => {
  const i = args.indexOf(flag)
  return i < 0 ? undefined : Number(args[i + 1])
}

/** The states the sample must reach among the accepted shapes of one architecture, as [name, predicate]. */
const coverage = (arch: SyntheticArch) => {
  const hidden = (a: ReadonlyArray<string>) => value(a, "--hidden")!
  const heads = (a: ReadonlyArray<string>) => value(a, "--heads")
  const states: Array<readonly [string, (a: ReadonlyArray<string>) => boolean]> = [
    ["hidden a multiple of 256", (a) => hidden(a) % 256 === 0],
    ["hidden not a multiple of 256", (a) => hidden(a) % 256 !== 0],
    ["hidden not a multiple of --heads", (a) => heads(a) !== undefined && hidden(a) % heads(a)! !== 0],
    ["hidden a multiple of --heads", (a) => heads(a) !== undefined && hidden(a) % heads(a)! === 0],
    ["a small vocabulary (at most 512)", (a) => value(a, "--vocab")! <= 512],
    ["a large vocabulary (8000 or more)", (a) => value(a, "--vocab")! >= 8000],
    ["a quantized type", (a) => a.includes("q8_0") || a.includes("q4_k")]
  ]
  // refused by design: qwen2 attends over the whole embedding (no head size of its own); gpt-oss has its own output
  const own = arch === "qwen2" ? states.filter(([name]) => name !== "hidden not a multiple of --heads") : states
  const refusedParts = arch === "qwen2" ? ["--head-dim"] : arch === "gpt-oss" ? ["--tied-output"] : []
  for (const flag of optionalFlags(arch).filter((f) => !refusedParts.includes(f))) {
    // a flag whose value 0 means "none" is on only with a positive value
    const on = (a: ReadonlyArray<string>) =>
      a.includes(flag) &&
      (["--tied-output", "--k-eq-v", "--double-wide-shared-ffn"].includes(flag) || value(a, flag)! > 0)
    own.push([`${flag} on`, on], [`${flag} off`, (a) => !on(a)])
  }
  return own
}

type Outcome =
  | { readonly _tag: "Accepted"; readonly args: ReadonlyArray<string>; readonly tokens: number }
  | { readonly _tag: "Refused"; readonly args: ReadonlyArray<string> }

/** Runs one command line; returns what is wrong with the outcome (undefined: nothing) and the outcome. */
const checkShape = (args: ReadonlyArray<string>, path: string) =>
  Effect.gen(function* () {
    const line = `synth ${args.join(" ")}`
    const exit = yield* runSynthCli([...args, "-o", path])
    if (Exit.isFailure(exit)) {
      const error = Option.getOrUndefined(Cause.failureOption(exit.cause))
      const message = error instanceof Error ? error.message : undefined
      const refused: Outcome = { _tag: "Refused", args }
      if (message === undefined || (error as { _tag?: string })._tag !== "SyntheticModelError")
        return [`${line}: not a typed refusal: ${Cause.pretty(exit.cause)}`, refused] as const
      if (message.includes("\n")) return [`${line}: refusal of more than one line: ${message}`, refused] as const
      const named = (message.match(/--[a-z][a-z-]*/g) ?? []).filter((flag) => args.includes(flag))
      if (named.length === 0) return [`${line}: refusal names no flag given: ${message}`, refused] as const
      if (existsSync(path)) return [`${line}: refused, yet a file was written`, refused] as const
      return [undefined, refused] as const
    }
    const accepted: Outcome = { _tag: "Accepted", args, tokens: 0 }
    const ref = yield* Effect.either(Effect.tryPromise(() => referenceRun(path, "Once upon a time", N_TOKENS, RUN)))
    if (ref._tag === "Left")
      return [`${line}: node-llama-cpp refuses the file: ${String(ref.left.error)}`, accepted] as const
    const layers = value(args, "--layers")!
    const ours = yield* Effect.either(greedyRun(path, [0, layers], ref.right.prompt, N_TOKENS, RUN))
    if (ours._tag === "Left") return [`${line}: swactor refuses the file: ${String(ours.left)}`, accepted] as const
    const expected = ref.right.tokens
    const got = ours.right.tokens
    const same =
      got.slice(0, expected.length).every((t, i) => t === expected[i]) &&
      (expected.length === N_TOKENS || got[expected.length] === EOS)
    if (!same) return [`${line}: tokens ${got.join(",")}, node-llama-cpp ${expected.join(",")}`, accepted] as const
    return [undefined, { ...accepted, tokens: expected.length }] as const
  })

describe("swactor synth: every shape it accepts loads in node-llama-cpp and matches; the rest are refused by flag", () => {
  for (const arch of syntheticArchs) {
    it.live(
      `${arch}: ${ACCEPTED} accepted shapes (layers 1-6) load and give node-llama-cpp's greedy tokens; refusals name a flag`,
      () =>
        Effect.gen(function* () {
          const r = makeRng(4100 + syntheticArchs.indexOf(arch))
          // the command line first (gemma4: 4 blocks, all of them sliding with the default pattern of 6)
          const fixed =
            arch === "gemma4"
              ? [["--arch", "gemma4", "--layers", "4", "--hidden", "256", "--ffn", "512", "--vocab", "512"]]
              : []
          const problems: Array<string> = []
          const accepted: Array<ReadonlyArray<string>> = []
          let fullRuns = 0
          let refusals = 0
          // each block count 1-6 in turn until accepted (or refused 8 times: gemma4 needs 2)
          const tries = new Map<number, number>()
          const nextLayers = () =>
            [1, 2, 3, 4, 5, 6].find(
              (n) => !accepted.some((a) => value(a, "--layers") === n) && (tries.get(n) ?? 0) < 8
            ) ?? 1 + Math.floor(r() * 6)
          for (let attempt = 0; accepted.length < ACCEPTED && attempt < ACCEPTED * 6; attempt++) {
            const layers = nextLayers()
            tries.set(layers, (tries.get(layers) ?? 0) + 1)
            const args = fixed[attempt] ?? drawShape(arch, layers, r)
            const [problem, outcome] = yield* checkShape(args, join(dir, `${arch}-${attempt}.gguf`))
            if (problem !== undefined) problems.push(problem)
            if (outcome._tag === "Accepted") {
              accepted.push(outcome.args)
              if (outcome.tokens === N_TOKENS) fullRuns++
            } else refusals++
          }
          assert.deepStrictEqual(problems, [], `${problems.length} shapes wrong`)
          assert.strictEqual(accepted.length, ACCEPTED, `only ${accepted.length} accepted, ${refusals} refused`)
          // end of sequence cuts few comparisons short
          assert.isAtLeast(fullRuns, ACCEPTED / 2, `only ${fullRuns} shapes compared ${N_TOKENS} tokens`)
          const layerCounts = new Set(accepted.map((a) => value(a, "--layers")))
          // llama.cpp's gemma4 cache needs 2 blocks, its qwen35 hybrid cache a DeltaNet and an attention block
          const counts = ["gemma4", "qwen35", "qwen35moe"].includes(arch) ? [2, 3, 4, 5, 6] : [1, 2, 3, 4, 5, 6]
          assert.deepStrictEqual([...layerCounts].filter((n) => n !== undefined).sort(), counts)
          const missed = coverage(arch)
            .filter(([, reached]) => !accepted.some(reached))
            .map(([name]) => name)
          assert.deepStrictEqual(missed, [], "states the sample never reached")
          console.log(`${arch}: ${accepted.length} shapes accepted and matched, ${refusals} refused by flag`)
        }),
      600_000
    )
  }
})
