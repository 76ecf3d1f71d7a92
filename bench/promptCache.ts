/**
 * bench:serve's prompt-cache figure: the second turn of a conversation of about 2,000 tokens (turn 1's prompt +
 * its text + a few more words) reaches its first token in at most 0.2x the time turn 1 took, on a warm pipeline with
 * the prompt cache on, with the text of the same turns on a pipeline with the cache off. Turn 1 is a miss (a full
 * prefill); turn 2 adopts turn 1's KV on every stage and prefills only the rest.
 *
 * The model's context must hold the conversation: stories260K's is 2,048 tokens (`--cache-model`, default
 * ../shared/models/stories260K.gguf when present, else the benchmark's model); the conversation is sized from the
 * model's context (turn 2 + its tokens within it).
 */
import { Effect, type Layer, ManagedRuntime, Stream } from "effect"
import { serve, Server } from "../src/api/serve.js"

interface Turn {
  readonly ttftMillis: number
  readonly text: string
  readonly promptTokens: number
  readonly cachedTokens: number
}

const story =
  "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. " +
  "One day, she saw a big red ball under a tree. She ran to get it and kicked it high in the sky. Her mom smiled. "

const turn = (runtime: ManagedRuntime.ManagedRuntime<Server, never>, prompt: string, maxTokens: number) =>
  runtime.runPromise(
    Effect.flatMap(Server, (server) =>
      Effect.suspend(() => {
        const start = performance.now()
        let first: number | undefined
        let text = ""
        let promptTokens = 0
        let cachedTokens = 0
        return server.generate({ prompt, maxTokens, sampling: { temperature: 0 } }).pipe(
          Stream.runForEach((event) =>
            Effect.sync(() => {
              if (event._tag === "Text") {
                first ??= performance.now()
                text += event.text
              }
              if (event._tag === "Done") {
                promptTokens = event.promptTokens
                cachedTokens = event.cachedTokens ?? 0
              }
            })
          ),
          Effect.map((): Turn => ({
            ttftMillis: (first ?? performance.now()) - start,
            text,
            promptTokens,
            cachedTokens
          }))
        )
      })
    )
  )

const median = (values: ReadonlyArray<number>) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)]!

/** Runs `rounds` two-turn conversations on a cache-on and a cache-off pipeline and prints the figure. */
export const promptCacheFigure = async (options: {
  readonly model: string
  readonly contextTokens: number
  readonly stages: number
  readonly threads: number
  readonly rounds: number
}) => {
  const reply = 32
  const open = (enabled: boolean) =>
    ManagedRuntime.make(
      serve({
        model: options.model,
        stages: options.stages,
        threads: options.threads,
        // room for the held entry beside the running turn (one sequence of the whole context each)
        parallel: 2,
        promptCache: { enabled }
      }) as Layer.Layer<Server>
    )
  const on = open(true)
  const off = open(false)
  try {
    await on.runPromise(Effect.flatMap(Server, (s) => s.ready))
    await off.runPromise(Effect.flatMap(Server, (s) => s.ready))
    // turn 1's prompt: as much story as leaves turn 2 (turn 1 + its reply + a few words) and its reply in the context
    let filler = ""
    const target = options.contextTokens - 3 * reply - 24
    const probe = await turn(off, story, 1)
    const perStory = probe.promptTokens - 1
    while ((filler.length / story.length) * perStory + perStory < target) filler += story
    const rows: Array<{ on1: Turn; on2: Turn; off1: Turn; off2: Turn }> = []
    for (let r = 0; r < options.rounds; r++) {
      // each round its own opening, so turn 1 shares nothing worth reusing with an earlier round's entries
      const prompt1 = `Round ${r + 1}. ${["Tom", "Sue", "Max", "Ann", "Bob"][r % 5]} went out. ${filler}`
      const on1 = await turn(on, prompt1, reply)
      const prompt2 = `${prompt1}${on1.text} Then they went home.`
      const on2 = await turn(on, prompt2, reply)
      const off1 = await turn(off, prompt1, reply)
      const off2 = await turn(off, prompt2, reply)
      rows.push({ on1, on2, off1, off2 })
    }
    console.log(
      `\nprompt cache (${options.model}, ${options.stages} stages x ${options.threads} thread(s)): a two-turn conversation, ` +
        `turn 2 = turn 1 + its ${reply}-token reply + a few words, greedy; time to first token (ms)`
    )
    console.log(
      "| round | turn 1 tokens | turn 1 TTFT | turn 2 tokens | cached | turn 2 TTFT | ratio | cache off: turn 2 TTFT | same text |"
    )
    console.log("|---|---|---|---|---|---|---|---|---|")
    rows.forEach((x, i) => {
      const same = x.on1.text === x.off1.text && x.on2.text === x.off2.text
      console.log(
        `| ${i + 1} | ${x.on1.promptTokens} | ${x.on1.ttftMillis.toFixed(1)} | ${x.on2.promptTokens} | ${x.on2.cachedTokens} | ` +
          `${x.on2.ttftMillis.toFixed(1)} | ${(x.on2.ttftMillis / x.on1.ttftMillis).toFixed(3)} | ${x.off2.ttftMillis.toFixed(1)} | ${same ? "yes" : "NO"} |`
      )
    })
    const ratio = median(rows.map((x) => x.on2.ttftMillis / x.on1.ttftMillis))
    const allSame = rows.every((x) => x.on1.text === x.off1.text && x.on2.text === x.off2.text)
    console.log(
      `target: turn 2's TTFT <= 0.2x turn 1's (median ratio ${ratio.toFixed(3)}: ${ratio <= 0.2 ? "met" : "NOT met"}), ` +
        `identical text with the cache off: ${allSame ? "yes" : "NO"}`
    )
  } finally {
    await on.dispose()
    await off.dispose()
  }
}
