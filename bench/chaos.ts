/**
 * chaos — N injected kills during generations with a spare, on local agents: each generation runs `stages`
 * stages + 1 spare; one stage agent (random stage) is killed with SIGKILL at a random moment (loading: when the
 * run is planned; prefill: when its stages are ready; decode: at a random token). Prints how many generations
 * recovered, how many equal the uninterrupted reference (greedy and seeded-sampled alternate), recovery time p50/p99/max
 * (kill → next token), and the agent processes and /dev/shm rings left after all (must be 0).
 *
 * Flags: --n 100 (kills), --model FILE (default: test models' stories260K; the 16×2048 synthetic model of the
 * other benches with --model .cache/bench/llama-16x2048-ffn8192-v32000-q8_0.gguf), --stages 3, --tokens 120,
 * --threads 1.
 */
import { execFileSync } from "node:child_process"
import { readdirSync } from "node:fs"
import { dirname, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import { Effect, Either, Stream } from "effect"
import { layerLocal, run } from "../src/api/generate.js"
import type { LocalAgent } from "../src/layers/agent/AgentProcesses.js"
import type { GenerateRequest, RunUpdate, SamplingOptions } from "../src/services/Orchestrator.js"

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")
const flag = (name: string, fallback: string): string => {
  const at = process.argv.indexOf(`--${name}`)
  return at >= 0 ? (process.argv[at + 1] ?? fallback) : fallback
}
const cfg = {
  n: Number(flag("n", "100")),
  model: resolve(
    flag("model", resolve(root, process.env["SWACTOR_MODELS_DIR"] ?? "../shared/models", "stories260K.gguf"))
  ),
  stages: Number(flag("stages", "3")),
  tokens: Number(flag("tokens", "120")),
  threads: Number(flag("threads", "1"))
}

type Moment = "loading" | "prefill" | "decode"

interface Outcome {
  readonly tokens: ReadonlyArray<number>
  readonly ok: boolean
  readonly error?: string
  readonly recoveryMillis?: number
  readonly agents: ReadonlyArray<LocalAgent>
}

const generation = (
  request: GenerateRequest,
  kill?: { readonly moment: Moment; readonly stage: number; readonly atToken: number }
) =>
  Effect.gen(function* () {
    let agents: ReadonlyArray<LocalAgent> = []
    let killedAt: number | undefined
    let recoveredAt: number | undefined
    let planned: ReadonlyArray<string> = []
    let ready = 0
    const tokens: Array<number> = []
    const killNow = () => {
      if (kill === undefined || killedAt !== undefined) return
      const address = planned[kill.stage]
      const agent = agents.find((a) => a.address === address)
      if (agent === undefined) return
      killedAt = performance.now()
      process.kill(agent.pid, "SIGKILL")
    }
    const result = yield* run(request).pipe(
      Stream.provideLayer(layerLocal({ threads: cfg.threads, onStarted: (a) => (agents = a) })),
      Stream.runForEach((update: RunUpdate) =>
        Effect.sync(() => {
          if (update._tag === "Planned" && planned.length === 0) {
            planned = update.stages.map((s) => s.address)
            if (kill?.moment === "loading") killNow()
          }
          if (update._tag === "StageReady" && ++ready === cfg.stages && kill?.moment === "prefill") killNow()
          if (update._tag === "Token" && update.token.tokenId >= 0) {
            if (killedAt !== undefined && recoveredAt === undefined) recoveredAt = performance.now()
            tokens.push(update.token.tokenId)
            if (kill?.moment === "decode" && update.token.step === kill.atToken) killNow()
          }
        })
      ),
      Effect.either
    )
    return {
      tokens,
      ok: Either.isRight(result),
      ...(Either.isLeft(result)
        ? { error: String((result.left as { message?: string }).message ?? result.left._tag) }
        : {}),
      ...(killedAt !== undefined && recoveredAt !== undefined ? { recoveryMillis: recoveredAt - killedAt } : {}),
      agents
    } satisfies Outcome
  })

const percentile = (values: ReadonlyArray<number>, p: number) => {
  if (values.length === 0) return NaN
  const sorted = [...values].sort((a, b) => a - b)
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]!
}

const alive = (pid: number) => {
  try {
    const stat = execFileSync("ps", ["-o", "stat=", "-p", String(pid)], { encoding: "utf8" }).trim()
    return stat !== "" && !stat.startsWith("Z")
  } catch {
    return false
  }
}

const main = Effect.gen(function* () {
  const samplings: ReadonlyArray<SamplingOptions | undefined> = [undefined, { temperature: 0.8, topK: 40, seed: 7 }]
  const base = (sampling: SamplingOptions | undefined): GenerateRequest => ({
    model: cfg.model,
    prompt: "Once upon a time",
    maxTokens: cfg.tokens,
    threads: cfg.threads,
    stages: cfg.stages,
    ...(sampling === undefined ? {} : { sampling })
  })
  const references: Array<ReadonlyArray<number>> = []
  for (const sampling of samplings) references.push((yield* generation(base(sampling))).tokens)
  console.log(`chaos: ${cfg.n} kills, ${cfg.stages} stages + 1 spare, ${cfg.tokens} tokens, model ${cfg.model}`)

  let recovered = 0
  let identical = 0
  const recoveryMillis: Array<number> = []
  const pids: Array<number> = []
  const moments: ReadonlyArray<Moment> = ["loading", "prefill", "decode"]
  for (let i = 0; i < cfg.n; i++) {
    const which = i % samplings.length
    const moment = moments[Math.floor(Math.random() * moments.length)]!
    const stage = Math.floor(Math.random() * cfg.stages)
    const atToken = Math.floor(Math.random() * Math.max(1, cfg.tokens - 1))
    const outcome = yield* generation({ ...base(samplings[which]), spares: 1 }, { moment, stage, atToken })
    pids.push(...outcome.agents.map((a) => a.pid))
    const same =
      outcome.ok &&
      outcome.tokens.length === references[which]!.length &&
      outcome.tokens.every((t, j) => t === references[which]![j])
    if (outcome.ok) recovered++
    if (same) identical++
    if (outcome.recoveryMillis !== undefined) recoveryMillis.push(outcome.recoveryMillis)
    console.log(
      `  #${i + 1} ${which === 0 ? "greedy" : "seeded"} kill stage ${stage} at ${moment}${moment === "decode" ? ` token ${atToken}` : ""}: ` +
        `${outcome.ok ? "recovered" : `FAULTED (${outcome.error})`}, ${same ? "identical" : "DIFFERENT"}` +
        `${outcome.recoveryMillis === undefined ? "" : `, kill → next token ${outcome.recoveryMillis.toFixed(0)} ms`}`
    )
  }
  yield* Effect.sleep("1 second")
  const orphans = pids.filter(alive).length
  const shm = readdirSync("/dev/shm").filter((name) => name.startsWith("swactor-")).length
  console.log(`recovered ${recovered}/${cfg.n}, identical output ${identical}/${cfg.n}`)
  console.log(
    `recovery (kill → next token) p50 ${percentile(recoveryMillis, 50).toFixed(0)} ms, p99 ${percentile(recoveryMillis, 99).toFixed(0)} ms, max ${Math.max(...recoveryMillis).toFixed(0)} ms over ${recoveryMillis.length}`
  )
  console.log(`left behind: ${orphans} agent processes, ${shm} /dev/shm rings`)
  if (recovered !== cfg.n || identical !== cfg.n || orphans !== 0 || shm !== 0) process.exitCode = 1
})

Effect.runPromise(main).catch((error) => {
  console.error(error)
  process.exit(1)
})
