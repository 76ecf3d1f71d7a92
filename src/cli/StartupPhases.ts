/** The start-up phases of one `swactor run`: when each ended, and the line that reports them. */
import { ms } from "./Units.js"

/**
 * Start-up phases of one `swactor run`, in milliseconds, as the command saw them (each from the end of the one before):
 * `process` launch to the command's start (Node and module loading), `checks` (flags, model metadata and vocabulary for
 * the context check), `spawn` (the orchestrator reads the model facts and tokenizer, starts or reaches the agents),
 * `pool` (control connections and the first heartbeats), `load` (plan, then every stage loaded and ready), `prefill`
 * (the prompt through the pipeline to the first token); `firstToken` is launch to first token.
 */
export interface StartupPhases {
  process: number
  checks: number
  spawn: number
  pool: number
  load: number
  prefill: number
  firstToken: number
}

/** Records when each phase ended; `performance.now()` counts from the process launch. */
export const makePhaseClock = () => {
  const marks: Partial<Record<"start" | "checked" | "spawned" | "pooled" | "ready" | "firstToken", number>> = {}
  const mark = (name: keyof typeof marks) => {
    marks[name] ??= performance.now()
  }
  const phases = (): StartupPhases | undefined => {
    const { checked, firstToken, pooled, ready, spawned, start } = marks
    if ([checked, firstToken, pooled, ready, spawned, start].some((m) => m === undefined)) return undefined
    const round = (x: number) => Math.round(x * 10) / 10
    return {
      process: round(start!),
      checks: round(checked! - start!),
      spawn: round(spawned! - checked!),
      pool: round(pooled! - spawned!),
      load: round(ready! - pooled!),
      prefill: round(firstToken! - ready!),
      firstToken: round(firstToken!)
    }
  }
  return { mark, phases }
}

export const renderPhases = (p: StartupPhases): string =>
  `start-up ${ms(p.firstToken)} ms to the first token: process ${ms(p.process)}, checks ${ms(p.checks)}, ` +
  `spawn ${ms(p.spawn)}, pool ${ms(p.pool)}, load ${ms(p.load)}, prefill ${ms(p.prefill)} ms`
