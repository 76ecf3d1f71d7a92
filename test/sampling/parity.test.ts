// llama.cpp's sampler chain on the last stage (specs/BEHAVIOR_GUARANTEES.md, "Sampling with llama.cpp's chain"): for
// the same settings and seed, `swactor run` at 1 and 2 stages gives node-llama-cpp's tokens (seeded temperature,
// penalties, a banned token, grammars, greedy), and the log-probs it reports are node-llama-cpp's raw distribution.
import { afterAll, beforeAll, describe, expect, it } from "vitest"
import { execFile } from "node:child_process"
import { mkdtempSync, rmSync, writeFileSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import {
  getLlama,
  type Llama,
  type LlamaModel,
  LlamaGrammar,
  LlamaGrammarEvaluationState,
  type Token,
  TokenBias
} from "node-llama-cpp"
import { swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { repoRoot, requireModel } from "../support/models.js"

interface Report {
  ok: boolean
  text: string
  tokens: Array<{
    id: number
    text: string
    logprob?: { logprob: number; top: Array<{ tokenId: number; logprob: number }> }
  }>
  fault?: { _tag: string; message: string }
}

const swactor = (args: ReadonlyArray<string>) =>
  new Promise<{ code: number; stdout: string; stderr: string }>((resolve) => {
    execFile(process.execPath, [swactorMain(), ...args], { cwd: repoRoot, timeout: 90_000 }, (error, stdout, stderr) =>
      resolve({ code: error ? (typeof error.code === "number" ? error.code : 1) : 0, stdout, stderr })
    )
  })

const PROMPT = "Once upon a time"
const MAX = 64

interface Settings {
  readonly temperature: number
  readonly topK?: number
  readonly minP?: number
  readonly seed?: number
  readonly repeat?: {
    readonly penalty: number
    readonly frequency: number
    readonly presence: number
    readonly lastN: number
  }
  readonly ban?: number
  readonly grammar?: string
}

let llama: Llama
let model: LlamaModel
let dir: string

/** node-llama-cpp's tokens for the settings: a sequence evaluation with the same sampler options, up to EOS or MAX. */
const reference = async (s: Settings): Promise<Array<number>> => {
  const ctx = await model.createContext({ threads: 1, contextSize: 256, flashAttention: true })
  try {
    const seq = ctx.getSequence()
    const prompt = [...(model.tokens.bos !== null ? [model.tokens.bos] : []), ...model.tokenize(PROMPT)]
    const out: Array<Token> = []
    const bias = s.ban === undefined ? undefined : new TokenBias(model.tokenizer)
    bias?.set(s.ban as Token, "never")
    const grammar = s.grammar === undefined ? undefined : new LlamaGrammar(llama, { grammar: s.grammar })
    const grammarEvaluationState =
      grammar === undefined ? undefined : new LlamaGrammarEvaluationState({ model, grammar })
    const repeat = s.repeat
    for await (const t of seq.evaluate(prompt, {
      temperature: s.temperature,
      topK: s.topK ?? 40,
      topP: 1,
      ...(s.minP === undefined ? {} : { minP: s.minP }),
      ...(s.seed === undefined ? {} : { seed: s.seed }),
      ...(repeat === undefined
        ? {}
        : {
            repeatPenalty: {
              punishTokens: () => out.slice(-repeat.lastN),
              maxPunishTokens: repeat.lastN,
              penalty: repeat.penalty,
              frequencyPenalty: repeat.frequency,
              presencePenalty: repeat.presence
            }
          }),
      ...(bias === undefined ? {} : { tokenBias: bias }),
      ...(grammarEvaluationState === undefined ? {} : { grammarEvaluationState }),
      yieldEogToken: true
    })) {
      out.push(t)
      if (model.isEogToken(t) || out.length >= MAX) break
    }
    return out.map(Number)
  } finally {
    await ctx.dispose()
  }
}

const flagsOf = (s: Settings): Array<string> => {
  const flags = ["--temperature", String(s.temperature), "--top-k", String(s.topK ?? 40)]
  if (s.minP !== undefined) flags.push("--min-p", String(s.minP))
  if (s.seed !== undefined) flags.push("--seed", String(s.seed))
  if (s.repeat !== undefined) {
    flags.push(
      "--repeat-penalty",
      String(s.repeat.penalty),
      "--frequency-penalty",
      String(s.repeat.frequency),
      "--presence-penalty",
      String(s.repeat.presence),
      "--penalty-last-n",
      String(s.repeat.lastN)
    )
  }
  if (s.ban !== undefined) flags.push("--logit-bias", `${s.ban}=-inf`)
  if (s.grammar !== undefined) {
    const file = join(dir, `g${Math.random().toString(36).slice(2)}.gbnf`)
    writeFileSync(file, s.grammar)
    flags.push("--grammar-file", file)
  }
  return flags
}

const run = async (stages: number, extra: ReadonlyArray<string>): Promise<Report> => {
  const path = requireModel("stories260K.gguf")
  const r = await swactor([
    "run",
    "--model",
    path,
    "--prompt",
    PROMPT,
    "--stages",
    String(stages),
    "--threads",
    "1",
    "--max-tokens",
    String(MAX),
    "--json",
    ...extra
  ])
  expect(r.code, r.stderr).toBe(0)
  return JSON.parse(r.stdout) as Report
}

/** swactor's token ids; the end-of-sequence token that stopped the run is not among them, so it is added back. */
const swactorTokens = async (stages: number, s: Settings, eos: number): Promise<Array<number>> => {
  const report = await run(stages, flagsOf(s))
  const ids = report.tokens.map((t) => t.id)
  return ids.length < MAX && ids.at(-1) !== eos ? [...ids, eos] : ids
}

const cases: ReadonlyArray<readonly [string, Settings]> = [
  ["greedy", { temperature: 0 }],
  ["seeded temperature, top-k and min-p", { temperature: 0.9, topK: 30, minP: 0.02, seed: 42 }],
  [
    "repeat, frequency and presence penalties",
    {
      temperature: 0.7,
      seed: 7,
      repeat: { penalty: 1.4, frequency: 0.3, presence: 0.4, lastN: 16 }
    }
  ],
  ["greedy with penalties", { temperature: 0, repeat: { penalty: 1.8, frequency: 0.5, presence: 0.5, lastN: 64 } }],
  ["a banned token (logit bias -inf)", { temperature: 0, ban: 432 }],
  ["a banned token, sampled", { temperature: 0.8, seed: 11, ban: 286 }],
  [
    "a grammar the model's picks often break (the chain draws again)",
    {
      temperature: 1,
      seed: 5,
      grammar: 'root ::= (" " [a-z]+)+ "."'
    }
  ]
]

describe("the sampler chain gives node-llama-cpp's tokens", () => {
  beforeAll(async () => {
    dir = mkdtempSync(join(tmpdir(), "swactor-parity-"))
    llama = await getLlama({ gpu: false, build: "never", logLevel: "error" as never })
    model = await llama.loadModel({ modelPath: requireModel("stories260K.gguf") })
  }, 120_000)
  afterAll(async () => {
    await model?.dispose()
    rmSync(dir, { recursive: true, force: true })
  })

  for (const [name, settings] of cases) {
    it(`${name}: 1 and 2 stages`, async () => {
      const expected = await reference(settings)
      const eos = model.tokens.eos ?? -1
      expect(expected.length).toBeGreaterThan(3)
      for (const stages of [1, 2]) {
        expect(await swactorTokens(stages, settings, eos), `${stages} stage(s)`).toEqual(expected)
      }
      // each setting changes the tokens (so the comparison can fail): without it node-llama-cpp gives others
      const { ban, grammar, repeat, ...plain } = settings
      if (ban !== undefined) {
        expect(expected).not.toContain(ban)
        expect(await reference(plain)).toContain(ban)
      }
      if (repeat !== undefined || grammar !== undefined) expect(await reference(plain)).not.toEqual(expected)
    }, 120_000)
  }

  it("bad sampling flags are one line naming the flag, exit 1; a grammar that does not parse faults the run in words", async () => {
    const path = requireModel("stories260K.gguf")
    const base = ["run", "--model", path, "--stages", "1", "--threads", "1", "--max-tokens", "4"]
    for (const [flags, words] of [
      [["--logit-bias", "5=abc"], "--logit-bias"],
      [["--grammar-file", join(dir, "missing.gbnf")], "--grammar-file"],
      [["--repeat-penalty", "0"], "--repeat-penalty"],
      [["--logprobs", "21"], "--logprobs"]
    ] as const) {
      const r = await swactor([...base, ...flags])
      expect(r.code, words).toBe(1)
      expect(r.stderr.trim().split("\n").at(-1), words).toContain(words)
      expect(r.stderr, words).not.toMatch(/\n\s+at .+:\d+:\d+/) // no stack trace
    }
    const bad = join(dir, "bad.gbnf")
    writeFileSync(bad, 'root ::= ("a" | ')
    const r = await swactor([...base, "--temperature", "0.5", "--grammar-file", bad])
    expect(r.code).not.toBe(0)
    expect(r.stderr).toMatch(/grammar: .* at line 1, column \d+/)
  }, 120_000)

  it("log-probs: the raw distribution node-llama-cpp reports at each step, top N sorted, across 2 stages", async () => {
    const n = 5
    const report = await run(2, [
      "--temperature",
      "0.8",
      "--seed",
      "3",
      "--repeat-penalty",
      "1.3",
      "--logprobs",
      String(n)
    ])
    expect(report.tokens.length).toBeGreaterThan(4)
    // the attention path and F16 cache the engine matches (flash attention on)
    const ctx = await model.createContext({ threads: 1, contextSize: 256, flashAttention: true })
    try {
      const seq = ctx.getSequence()
      const prompt = [...(model.tokens.bos !== null ? [model.tokens.bos] : []), ...model.tokenize(PROMPT)]
      const ids = report.tokens.map((t) => t.id as Token)
      // the distribution after the prompt and after each generated token but the last (greedy: no truncation), one
      // token at a time as the pipeline decodes
      const next = { generateNext: { probabilities: true, options: { temperature: 0 } } } as const
      const distributions: Array<Map<Token, number>> = []
      const steps = [[...prompt.slice(0, -1), [prompt.at(-1)!, next]], ...ids.slice(0, -1).map((id) => [[id, next]])]
      for (const step of steps) {
        const results = await seq.controlledEvaluate(step as never)
        distributions.push(results.at(-1)!.next!.probabilities!)
      }
      expect(distributions.length).toBe(ids.length)
      report.tokens.forEach((token, i) => {
        const lp = token.logprob!
        expect(lp.top.length).toBe(n)
        for (let k = 1; k < n; k++) expect(lp.top[k]!.logprob).toBeLessThanOrEqual(lp.top[k - 1]!.logprob)
        // node-llama-cpp's own run of the model: its logits differ from the pipeline's by float rounding only
        const close = (a: number, b: number) => expect(Math.abs(a - b), `${a} vs ${b}`).toBeLessThan(1e-4)
        const probs = distributions[i]!
        close(lp.logprob, Math.log(probs.get(token.id as Token)!))
        const best = [...probs.entries()].sort((a, b) => b[1] - a[1]).slice(0, n)
        lp.top.forEach((t, k) => close(t.logprob, Math.log(best[k]![1])))
        expect(lp.top[0]!.tokenId).toBe(best[0]![0])
        // the sampled token's own figure is the same number as its entry among the alternatives
        const own = lp.top.find((t) => t.tokenId === token.id)
        if (own !== undefined) expect(own.logprob).toBe(lp.logprob)
      })
    } finally {
      await ctx.dispose()
    }
  }, 120_000)
})
