/**
 * A stage's measured step cost by row count, and the decode micro-batch size chosen from it.
 *
 * ggml's CPU kernels do not cost in proportion to rows (the repacked matrix kernels take rows four at a time, pairs
 * and single rows otherwise; figures in bench/README.md, "Design measurements"). So how L decoding sequences are cut
 * into micro-batches on a pipeline of S stages matters: every stage runs each micro-batch once per round, and a
 * micro-batch comes back only after all S stages ran it, so a round takes at least max(Σ t(parts), S × max t(parts)).
 * The batcher's default, ceil(L / S) rows per micro-batch (S micro-batches in flight), is kept unless another size is
 * measured to be clearly faster (5%): e.g. 6 sequences on 2 stages as 2 + 2 + 2 rather than 3 + 3 where three rows
 * cost about what four do.
 */

/** Estimates of one stage's forward time (ms) by rows, from measured forwards. */
export interface StepCosts {
  /**
   * A forward of `rows` rows took `millis`. Per row count the estimate is the lower median of its last few
   * observations: one slow step (a busy machine, a page fault) does not move it; a lasting change does.
   */
  readonly observe: (rows: number, millis: number) => void
  /** The estimate for `rows` rows: measured, else interpolated between measured row counts; undefined beyond them. */
  readonly estimate: (rows: number) => number | undefined
  /** Every measured row count and its estimate, by rows. */
  readonly entries: () => ReadonlyArray<{ readonly rows: number; readonly millis: number }>
  /** Grows whenever an estimate changes: a choice made from these costs at the same revision still holds. */
  readonly revision: () => number
}

export const makeStepCosts = (window = 5): StepCosts => {
  /** The last `window` observations per row count (oldest first); the estimate is their lower median. */
  const recent = new Map<number, Array<number>>()
  const measured = new Map<number, number>()
  let changes = 0
  const observe = (rows: number, millis: number) => {
    if (!Number.isSafeInteger(rows) || rows < 1 || !Number.isFinite(millis) || millis < 0) return
    const list = recent.get(rows) ?? []
    list.push(millis)
    if (list.length > window) list.shift()
    recent.set(rows, list)
    const sorted = [...list].sort((a, b) => a - b)
    const next = sorted[Math.floor((sorted.length - 1) / 2)]!
    if (measured.get(rows) !== next) changes++
    measured.set(rows, next)
  }
  const estimate = (rows: number): number | undefined => {
    const exact = measured.get(rows)
    if (exact !== undefined) return exact
    let below: number | undefined
    let above: number | undefined
    for (const r of measured.keys()) {
      if (r < rows && (below === undefined || r > below)) below = r
      if (r > rows && (above === undefined || r < above)) above = r
    }
    if (below === undefined || above === undefined) return undefined
    const a = measured.get(below)!
    const b = measured.get(above)!
    return a + ((b - a) * (rows - below)) / (above - below)
  }
  const entries = () => [...measured].sort(([a], [b]) => a - b).map(([rows, millis]) => ({ rows, millis }))
  return { observe, estimate, entries, revision: () => changes }
}

/** `total` rows as micro-batches of `size` (the last one smaller when it does not divide). */
export const partsOf = (total: number, size: number): Array<number> => {
  const parts = Array.from({ length: Math.floor(total / size) }, () => size)
  if (total % size > 0) parts.push(total % size)
  return parts
}

/** The least time one round of micro-batches `parts` takes through `stages` stages that cost `cost` each. */
export const roundMillis = (parts: ReadonlyArray<number>, stages: number, cost: (rows: number) => number): number => {
  let sum = 0
  let max = 0
  for (const p of parts) {
    const t = cost(p)
    sum += t
    max = Math.max(max, t)
  }
  return Math.max(sum, stages * max)
}

export interface DecodeGroupChoice {
  /** Most decode steps in one micro-batch. */
  readonly rows: number
  /** ceil(decoders / stages): the size without measured costs. */
  readonly defaultRows: number
  /** The estimated round (ms) at `rows` and at `defaultRows`; undefined where a row count has no estimate. */
  readonly roundMillis?: number
  readonly defaultRoundMillis?: number
}

/**
 * How many of `decoders` sequences decoding through `stages` stages one micro-batch takes: the size whose estimated
 * round is least, where it beats ceil(decoders / stages)'s by over `margin` (default 5%); that default otherwise, and
 * when a size it would compare has no estimate.
 */
export const chooseDecodeGroup = (
  decoders: number,
  stages: number,
  costs: Pick<StepCosts, "estimate">,
  margin = 0.05
): DecodeGroupChoice => {
  const l = Math.max(1, Math.floor(decoders))
  const s = Math.max(1, Math.floor(stages))
  const defaultRows = Math.ceil(l / s)
  if (l === 1) return { rows: 1, defaultRows }
  const known = (size: number) => partsOf(l, size).every((p) => costs.estimate(p) !== undefined)
  if (!known(defaultRows)) return { rows: defaultRows, defaultRows }
  const cost = (rows: number) => costs.estimate(rows)!
  const base = roundMillis(partsOf(l, defaultRows), s, cost)
  let best = { rows: defaultRows, round: base }
  for (let size = 1; size <= l; size++) {
    if (size === defaultRows || !known(size)) continue
    const round = roundMillis(partsOf(l, size), s, cost)
    if (round < best.round) best = { rows: size, round }
  }
  const rows = best.round < base * (1 - margin) ? best.rows : defaultRows
  return { rows, defaultRows, roundMillis: rows === defaultRows ? base : best.round, defaultRoundMillis: base }
}
