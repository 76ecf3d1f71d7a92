/**
 * Per-stage straggler detection, pure: each stage's agent reports its decode steps' times while the run goes on
 * (StageTimings: engine time and hand-off to the next stage per step); a step whose time exceeds `factor` × the
 * median of that stage's `window` steps before it — once the stage has `minSamples` steps, and by at least
 * `minExcessMillis` — is a straggler of that stage. A slow token end to end is then pinned on the stage that made
 * it slow, not on the pipeline.
 */
import type { StageStragglers, StageStragglerToken, StragglerRule } from "./Orchestrator.js"

export const defaultStragglerRule: StragglerRule = { factor: 4, window: 16, minSamples: 8, minExcessMillis: 5 }

/** One decode step of one stage, as its agent reported it. */
export interface StageStep {
  readonly step: number
  readonly computeMillis: number
  readonly sendMillis: number
}

export const median = (values: ReadonlyArray<number>): number => {
  if (values.length === 0) return 0
  const sorted = [...values].sort((a, b) => a - b)
  const mid = sorted.length >> 1
  return sorted.length % 2 === 1 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2
}

interface StageTrack {
  readonly address: string
  readonly steps: Array<number>
  sendTotal: number
  readonly stragglers: Array<StageStragglerToken>
}

/** Per-stage summary of what the detector saw (every stage that reported steps). */
export interface StageStepSummary {
  readonly stageIndex: number
  readonly steps: number
  readonly medianMillis: number
  readonly sendMillisPerStep: number
}

export interface StageStragglerDetector {
  /** Adds a stage's reported steps; returns those that straggle, in order. */
  readonly add: (
    stageIndex: number,
    address: string,
    steps: ReadonlyArray<StageStep>
  ) => ReadonlyArray<StageStragglerToken>
  /** Each stage's steps so far. */
  readonly stages: () => ReadonlyArray<StageStepSummary>
  /** The stages with stragglers, by stage index. */
  readonly stragglers: () => ReadonlyArray<StageStragglers>
}

export const makeStageStragglerDetector = (overrides: Partial<StragglerRule> = {}): StageStragglerDetector => {
  const rule: StragglerRule = { ...defaultStragglerRule, ...overrides }
  const tracks = new Map<number, StageTrack>()
  const add = (stageIndex: number, address: string, steps: ReadonlyArray<StageStep>) => {
    let track = tracks.get(stageIndex)
    if (track === undefined) {
      track = { address, steps: [], sendTotal: 0, stragglers: [] }
      tracks.set(stageIndex, track)
    }
    const found: Array<StageStragglerToken> = []
    for (const step of steps) {
      const millis = step.computeMillis + step.sendMillis
      if (track.steps.length >= rule.minSamples) {
        const m = median(track.steps.slice(-rule.window))
        if (millis > rule.factor * m && millis - m >= rule.minExcessMillis) {
          const straggler = { stageIndex, address, step: step.step, millis, medianMillis: m }
          track.stragglers.push(straggler)
          found.push(straggler)
        }
      }
      track.steps.push(millis)
      track.sendTotal += step.sendMillis
    }
    return found
  }
  const sorted = () => [...tracks].sort(([a], [b]) => a - b)
  return {
    add,
    stages: () =>
      sorted().map(([stageIndex, t]) => ({
        stageIndex,
        steps: t.steps.length,
        medianMillis: median(t.steps),
        sendMillisPerStep: t.steps.length > 0 ? t.sendTotal / t.steps.length : 0
      })),
    stragglers: () =>
      sorted().flatMap(([stageIndex, t]) => {
        if (t.stragglers.length === 0) return []
        const worst = t.stragglers.reduce((a, b) => (b.millis > a.millis ? b : a))
        return [
          {
            stageIndex,
            address: t.address,
            tokens: t.stragglers.length,
            medianMillis: median(t.steps),
            worstMillis: worst.millis,
            worstStep: worst.step
          }
        ]
      })
  }
}

/** A StageTimings report's parallel arrays as steps. */
export const stepsOf = (report: {
  readonly steps: ReadonlyArray<number>
  readonly computeMillis: ReadonlyArray<number>
  readonly sendMillis: ReadonlyArray<number>
}): ReadonlyArray<StageStep> =>
  report.steps.map((step, i) => ({
    step,
    computeMillis: report.computeMillis[i] ?? 0,
    sendMillis: report.sendMillis[i] ?? 0
  }))
